"""The X-Image-Id header: the image_id where a proxy can read it, held to the bytes.

Against the real service (tiny models on the CPU): every image route takes the header; it
must name the image sent (422 image_id_mismatch otherwise, and nothing is cached under
either id); alone, it names the image as the image_id field does; a malformed one is 422.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable

import httpx
import pytest

from tests.server.conftest import LiveServer, encode, photo_like

CLICK = {"point_coords": [[40, 30]], "point_labels": [1]}


def image_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def photo(seed: int) -> bytes:
    return encode(photo_like(96, 72, seed=seed))


def files(data: bytes) -> dict[str, tuple[str, bytes, str]]:
    return {"image": ("p.jpg", data, "image/jpeg")}


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    message: str = error["message"]
    return message


def is_cached(client: httpx.Client, image: str) -> bool:
    response = client.post("/v1/embed", json={"image_id": image})
    assert response.status_code in (200, 404), response.text
    return response.status_code == 200


def test_the_header_that_names_the_bytes_is_taken_everywhere(client: httpx.Client) -> None:
    data = photo(101)
    header = {"X-Image-Id": image_id(data)}
    embedded = client.post("/v1/embed", files=files(data), headers=header)
    assert embedded.status_code == 200, embedded.text
    assert embedded.json()["image_id"] == image_id(data)
    b64 = base64.b64encode(data).decode()
    for path, fields in (("/v1/segment", CLICK), ("/v1/classify", {"top_k": 2}),
                         ("/v1/segment/everything", {"points_per_side": 2})):  # fmt: skip
        as_json = client.post(path, json={"image": b64, **fields}, headers=header)
        assert as_json.status_code == 200, (path, as_json.text)
        form = {"request": json.dumps(fields)}
        as_form = client.post(path, files=files(data), data=form, headers=header)
        assert as_form.status_code == 200, (path, as_form.text)
    by_id = client.post("/v1/segment", json={"image_id": image_id(data), **CLICK}, headers=header)
    assert by_id.status_code == 200 and by_id.json()["image_id"] == image_id(data)
    npy = client.get(f"/v1/embeddings/{image_id(data)}", headers=header)
    assert npy.status_code == 200 and npy.content.startswith(b"\x93NUMPY")


def test_the_header_alone_names_the_image(client: httpx.Client) -> None:
    data = photo(102)
    header = {"X-Image-Id": image_id(data)}
    assert client.post("/v1/embed", files=files(data)).status_code == 200
    lookup = client.post("/v1/embed", json={}, headers=header)
    assert lookup.status_code == 200 and lookup.json()["cached"] is True
    click = client.post("/v1/segment", json=CLICK, headers=header)
    assert click.status_code == 200, click.text
    assert click.json()["image_id"] == image_id(data)
    every = client.post("/v1/segment/everything", json={"points_per_side": 2}, headers=header)
    assert every.status_code == 200, every.text
    # an image the server never saw: the same 404 as the field gives
    unknown = {"X-Image-Id": image_id(b"never sent")}
    assert_error(client.post("/v1/segment", json=CLICK, headers=unknown), 404, "unknown_image_id")
    # classify needs pixels: the header is not an image
    message = assert_error(
        client.post("/v1/classify", json={}, headers=header), 422, "invalid_request"
    )
    assert "needs the image itself" in message
    # neither field nor header: the message names all three ways
    message = assert_error(client.post("/v1/segment", json=CLICK), 422, "invalid_request")
    assert "X-Image-Id" in message


def test_a_header_naming_another_image_is_refused_and_nothing_is_cached(
    client: httpx.Client,
) -> None:
    data, other = photo(103), photo(104)
    wrong = {"X-Image-Id": image_id(other)}
    b64 = base64.b64encode(data).decode()
    attempts = [
        client.post("/v1/embed", files=files(data), headers=wrong),
        client.post("/v1/embed", json={"image": b64}, headers=wrong),
        client.post("/v1/segment", json={"image": b64, **CLICK}, headers=wrong),
        client.post("/v1/classify", files=files(data), headers=wrong),
        client.post("/v1/segment/everything", files=files(data), headers=wrong),
    ]
    for response in attempts:
        message = assert_error(response, 422, "image_id_mismatch")
        assert image_id(other) in message and image_id(data) in message
    assert not is_cached(client, image_id(data)) and not is_cached(client, image_id(other))

    # an id in the body and another in the header
    assert client.post("/v1/embed", files=files(data)).status_code == 200
    both = {"image_id": image_id(data), **CLICK}
    assert_error(client.post("/v1/segment", json=both, headers=wrong), 422, "image_id_mismatch")
    download = client.get(f"/v1/embeddings/{image_id(data)}", headers=wrong)
    assert_error(download, 422, "image_id_mismatch")
    # the refusals harmed nothing: the right header still works
    right = {"X-Image-Id": image_id(data)}
    assert client.post("/v1/segment", json=CLICK, headers=right).status_code == 200


@pytest.mark.parametrize(
    "value",
    ["abc", "A" * 64, "0" * 63, "0" * 65, "g" * 64, "0" * 64 + ",1", "0" * 63 + " 0", ""],
)
def test_a_malformed_header_is_422(client: httpx.Client, value: str) -> None:
    data = photo(105)
    header = {"X-Image-Id": value}
    for response in (
        client.post("/v1/embed", files=files(data), headers=header),
        client.post("/v1/segment", json={"image_id": image_id(data), **CLICK}, headers=header),
        client.get(f"/v1/embeddings/{image_id(data)}", headers=header),
    ):
        message = assert_error(response, 422, "invalid_request")
        assert "X-Image-Id" in message


def test_the_openapi_documents_the_header(client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    routes = [("/v1/embed", "post"), ("/v1/segment", "post"), ("/v1/classify", "post"),
              ("/v1/segment/everything", "post"), ("/v1/embeddings/{image_id}", "get")]  # fmt: skip
    for path, method in routes:
        parameters = paths[path][method].get("parameters", [])
        (header,) = [p for p in parameters if p["name"] == "X-Image-Id"]
        assert header["in"] == "header" and header["required"] is False
        assert header["schema"]["pattern"] == "^[0-9a-f]{64}$"
        assert "image_id_mismatch" in header["description"]


def test_a_page_of_another_origin_may_send_the_header(
    make_server: Callable[..., LiveServer],
) -> None:
    """With CORS on, the browser's preflight for X-Image-Id is allowed."""
    server = make_server(cors_origins=["https://annotate.example"])
    preflight = httpx.options(
        server.url + "/v1/segment",
        headers={
            "Origin": "https://annotate.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-image-id",
        },
    )
    assert preflight.status_code == 200, preflight.text
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "x-image-id" in allowed
