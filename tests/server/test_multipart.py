"""`server.http.multipart` reads what HTTP clients send exactly as Starlette's parser does, and
declines (None) whatever is not plainly well formed, so Starlette keeps the last word."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.datastructures import UploadFile
from starlette.requests import Request

from server.errors import ServiceError
from server.http.multipart import MAX_PART_HEADER_BYTES, FormPart, boundary_of, read_form

JPEG_LIKE = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n\r\n" + b"\xff\xd9"


def encoded(files: object = None, data: object = None) -> tuple[bytes, str]:
    """A body and its content type, as httpx (the real client library) writes them."""
    request = httpx.Request("POST", "http://service/v1/segment", files=files, data=data)
    return request.read(), request.headers["content-type"]


def starlette_parts(body: bytes, content_type: str) -> list[FormPart]:
    """Starlette's own parser on the same body: the reference."""

    async def parse() -> list[FormPart]:
        sent = False

        async def receive() -> dict[str, object]:
            nonlocal sent
            chunk, sent = (b"" if sent else body), True
            return {"type": "http.request", "body": chunk, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/",
            "headers": [(b"content-type", content_type.encode("latin-1"))],
        }
        form = await Request(scope, receive).form(max_files=100, max_fields=100)
        parts = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                parts.append(FormPart(name, value.filename or "", await value.read()))
            else:
                parts.append(FormPart(name, None, value.encode("utf-8")))
        await form.close()
        return parts

    return asyncio.run(parse())


CASES = {
    "file and field": ({"image": ("a.jpg", JPEG_LIKE, "image/jpeg")}, {"request": '{"box": [1]}'}),
    "file only": ({"image": ("photo.jpg", JPEG_LIKE, "image/jpeg")}, None),
    "request as a file": (
        [("image", ("a.jpg", JPEG_LIKE, "image/jpeg")), ("request", ("r.json", b"{}", "a/b"))],
        None,
    ),
    "empty file and field": ({"image": ("e.jpg", b"", "image/jpeg")}, {"request": ""}),
    "unicode and quotes": (
        {"image": ('caf\u00e9 "1".jpg', JPEG_LIKE, "image/jpeg")},
        {"request": json.dumps({"note": "\u00e9\u00e8 \u2603"})},
    ),
    "repeated and unknown parts": (
        [("image", ("a.jpg", b"1", "image/jpeg")), ("image", ("b.jpg", b"2", "image/jpeg"))],
        {"x": "1", "request": ["a", "b"]},
    ),
    "file without content type": ({"image": ("a.bin", b"\x00\r\n\r\n\x01")}, None),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_reads_what_starlette_reads(case: str) -> None:
    files, data = CASES[case]
    body, content_type = encoded(files, data)
    boundary = boundary_of(content_type)
    assert boundary is not None
    parts = read_form(body, boundary, max_parts=20)
    assert parts is not None, "a body httpx wrote must be read here"
    assert parts == starlette_parts(body, content_type)


def test_boundaries() -> None:
    assert boundary_of("multipart/form-data; boundary=abc123") == b"abc123"
    assert boundary_of('Multipart/Form-Data; charset=utf-8; Boundary="a b:c"') == b"a b:c"
    assert boundary_of("multipart/form-data") is None
    assert boundary_of("multipart/mixed; boundary=abc") is None
    assert boundary_of("multipart/form-data; boundary=") is None
    assert boundary_of("multipart/form-data; boundary=" + "x" * 71) is None
    assert boundary_of('multipart/form-data; boundary="ends in space "') is None
    assert boundary_of("multipart/form-data; boundary=bad<char>") is None


def part(headers: str, data: bytes = b"x") -> bytes:
    return b"--b\r\n" + headers.encode() + b"\r\n\r\n" + data + b"\r\n"


GOOD = part('Content-Disposition: form-data; name="image"; filename="a.jpg"')


@pytest.mark.parametrize(
    "body",
    [
        b"preamble\r\n" + GOOD + b"--b--\r\n",  # a preamble
        GOOD,  # no closing delimiter
        GOOD.replace(b"\r\n", b"\n") + b"--b--\n",  # bare LF line ends
        part("Content-Type: text/plain") + b"--b--\r\n",  # no Content-Disposition
        part('Content-Disposition: attachment; name="image"') + b"--b--\r\n",
        part('Content-Disposition: form-data; filename="a"') + b"--b--\r\n",  # no name
        part('Content-Disposition: form-data;\r\n name="image"') + b"--b--\r\n",  # folded
        part("Content-Disposition: form-data; name*=utf-8''image") + b"--b--\r\n",
        part('Content-Disposition: form-data; name="a"; name="b"') + b"--b--\r\n",
        b"--b junk\r\n" + GOOD[5:] + b"--b--\r\n",  # text after a delimiter
        b'--b\r\nContent-Disposition: form-data; name="a"\r\nx\r\n--b--\r\n',  # no blank line
        b"no parts here at all",
    ],
)
def test_declines_what_is_not_plainly_well_formed(body: bytes) -> None:
    assert read_form(body, b"b", max_parts=20) is None


def test_closing_delimiter_alone_is_an_empty_form_and_parts_are_bounded() -> None:
    assert read_form(b"--b--\r\n", b"b", max_parts=20) == []
    assert read_form(b"--b--", b"b", max_parts=20) == []
    three = GOOD * 3 + b"--b--\r\n"
    assert read_form(three, b"b", max_parts=3) is not None
    assert read_form(three, b"b", max_parts=2) is None


def test_headers_past_the_cap_are_a_400() -> None:
    name = "x" * MAX_PART_HEADER_BYTES
    body = part(f'Content-Disposition: form-data; name="image"; filename="{name}"') + b"--b--\r\n"
    with pytest.raises(ServiceError) as refused:
        read_form(body, b"b", max_parts=4)
    assert refused.value.status == 400
    body = part(f'Content-Disposition: form-data; name="image"; filename="{name[:3000]}"')
    assert read_form(body + b"--b--\r\n", b"b", max_parts=4) is not None
