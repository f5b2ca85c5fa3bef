"""The page at `/`, used in a real browser (Chromium through Playwright) on a real server.

What a person sees is pixels, so the checks read the canvases back rather than trusting
the DOM: the overlay after a click must be exactly the mask the server sent (decoded with
pycocotools), segment-everything must paint several colours, and the downloaded PNG must
be that mask again. The server is the CPU one of conftest.py (tiny random-weight models).

Needs Chromium (`apt-get install -y chromium`) and `pip install playwright`; Playwright's
own browser download is not used.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, Request, expect, sync_playwright
from pycocotools import mask as mask_utils

from tests.conftest import SYNTHETIC_TIMEOUT_S
from tests.server.conftest import PHOTOS, LiveServer, encode

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # without these, the closed network refuses it
    "--disable-component-update",
    "--disable-sync",
]
DOG = PHOTOS / "dog.jpg"
DOG_SIZE = (800, 534)  # width, height

# Canvas read-backs, done in the page so only a summary crosses over.
COVERAGE_JS = """(id) => {
  const c = document.getElementById(id);
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const bytes = new Uint8Array(c.width * c.height);
  for (let i = 0; i < bytes.length; i += 1) bytes[i] = d[4 * i + 3] > 0 ? 1 : 0;
  let s = "";
  for (let i = 0; i < bytes.length; i += 8192) {
    s += String.fromCharCode(...bytes.subarray(i, i + 8192));
  }
  return { width: c.width, height: c.height, alpha: btoa(s) };
}"""
COLORS_JS = """(id) => {
  const c = document.getElementById(id);
  const pixels = c.getContext("2d").getImageData(0, 0, c.width, c.height);
  const words = new Uint32Array(pixels.data.buffer);
  const counts = new Map();
  for (const w of words) if (w >>> 24) counts.set(w, (counts.get(w) ?? 0) + 1);
  return [...counts.values()];
}"""
DECODE_JS = """async (rles) => {
  const { decodeRle } = await import("/static/rle.js");
  return rles.map((rle) => {
    const m = decodeRle(rle);
    let s = "";
    for (let i = 0; i < m.length; i += 8192) {
      s += String.fromCharCode(...m.subarray(i, i + 8192));
    }
    return btoa(s);
  });
}"""

DROP_JS = """(b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], "dog.jpg", { type: "image/jpeg" }));
  const stage = document.getElementById("stage");
  stage.dispatchEvent(new DragEvent("dragover", { dataTransfer: data, bubbles: true }));
  stage.dispatchEvent(new DragEvent("drop", { dataTransfer: data, bubbles: true }));
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One Chromium for the module: launching costs about a second; pages are cheap."""
    executable = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(executable).exists():
        pytest.fail("Chromium is missing: apt-get install -y chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab (own sessionStorage); an uncaught script error fails the test.

    So do console errors (a CSP refusal, a failed module import), except the browser's own
    note on each 4xx response, which the tests provoke on purpose.
    """
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)  # two busy cores: a segment-everything run takes seconds
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


# -- helpers -------------------------------------------------------------------------


def decode(rle: dict[str, Any]) -> np.ndarray:
    """The pycocotools reading of a response's mask: bool [H, W]."""
    counts = rle["counts"]
    raw = {"size": rle["size"], "counts": counts.encode() if isinstance(counts, str) else counts}
    return mask_utils.decode(raw).astype(bool)


def covered(page: Page, canvas: str = "mask-canvas") -> np.ndarray:
    """Pixels of a canvas that are painted at all: bool [H, W]."""
    got = page.evaluate(COVERAGE_JS, canvas)
    flat = np.frombuffer(base64.b64decode(got["alpha"]), dtype=np.uint8)
    return flat.reshape(got["height"], got["width"]).astype(bool)


def wait_idle(page: Page) -> None:
    """The page clears `busy` after it has drawn the answer (or shown the error)."""
    page.wait_for_function("() => !document.getElementById('stage').classList.contains('busy')")


def screen_point(page: Page, x: float, y: float) -> tuple[float, float]:
    """Image pixel (x, y) -> where to put the mouse (the canvas is scaled by CSS)."""
    box = page.locator("#prompt-canvas").bounding_box()
    assert box is not None
    return box["x"] + x * box["width"] / DOG_SIZE[0], box["y"] + y * box["height"] / DOG_SIZE[1]


def answer_of(page: Page, path: str, action: Callable[[], None]) -> dict[str, Any]:
    """Do `action`, return the JSON the page got from `path`, once the page has drawn it."""
    with page.expect_response(lambda r: r.url.endswith(path)) as info:
        action()
    response = info.value
    assert response.ok, f"{path}: {response.status} {response.text()}"
    wait_idle(page)
    return dict(response.json())


def open_dog(page: Page, server: LiveServer) -> None:
    page.goto(server.url + "/")
    page.set_input_files("#file-input", DOG)


def record_calls(page: Page) -> list[Request]:
    """Every request the page makes to the API, in order."""
    calls: list[Request] = []
    page.on("request", lambda r: calls.append(r) if "/v1/" in r.url else None)
    return calls


def sent_json(calls: list[Request], path: str = "/v1/segment") -> list[dict[str, Any]]:
    """The JSON bodies the page sent to `path`, oldest first."""
    return [dict(r.post_data_json or {}) for r in calls if r.url.endswith(path)]


# -- tests ---------------------------------------------------------------------------


def test_page_and_static_files_are_served_safely(live_server: LiveServer) -> None:
    """Right types, revalidating cache headers, 304s, and no way out of the folder."""
    with httpx.Client(base_url=live_server.url, timeout=10) as c:
        index = c.get("/")
        assert index.status_code == 200
        assert index.headers["content-type"] == "text/html; charset=utf-8"
        assert index.headers["cache-control"] == "no-cache"
        assert index.headers["x-content-type-options"] == "nosniff"
        assert "frame-ancestors 'none'" in index.headers["content-security-policy"]
        assert '<script type="module" src="/static/app.js">' in index.text
        again = c.get("/", headers={"If-None-Match": index.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        for name, kind in [
            ("app.js", "text/javascript"),
            ("rle.js", "text/javascript"),
            ("style.css", "text/css"),
            ("favicon.svg", "image/svg+xml"),
        ]:
            r = c.get(f"/static/{name}")
            assert r.status_code == 200, name
            assert r.headers["content-type"].startswith(kind), name
            assert r.headers["etag"] and r.headers["cache-control"] == "no-cache"
        head = c.head("/static/app.js")
        assert head.status_code == 200 and head.content == b""
        assert int(head.headers["content-length"]) == len(c.get("/static/app.js").content)
        assert c.get("/favicon.ico").headers["content-type"] == "image/svg+xml"
        for path in [
            "/static/%2e%2e/page.py",
            "/static/..%2fpage.py",
            "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
            "/static/.hidden.js",
            "/static/nope.js",
            "/static/index.html/",
            "/static/",
            "/static/app.py",
        ]:
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found", path


def test_point_box_candidates_download_and_everything(
    page: Page, live_server: LiveServer, tmp_path: Path
) -> None:
    """One person's session, step by step: each step builds on the screen the last left."""
    calls = record_calls(page)
    page.goto(live_server.url + "/")
    warning = page.locator("#random-warning")
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("random weights")
    expect(page.locator("#models li")).to_have_count(2)
    expect(page.locator("#models")).to_contain_text("fp32")
    expect(page.locator("#models")).to_contain_text("weights: random")
    expect(page.locator("#synthetic-note")).to_be_hidden()

    # The photo is on the canvas as soon as it is opened, pixel for pixel (JPEG decoders
    # may differ by a few levels).
    with page.expect_response(lambda r: r.url.endswith("/v1/embed")) as embedded:
        page.set_input_files("#file-input", DOG)
    image_id = embedded.value.json()["image_id"]
    shown = page.evaluate(
        "() => Array.from(document.getElementById('image-canvas').getContext('2d')"
        ".getImageData(400, 260, 1, 1).data)"
    )
    expected = np.asarray(Image.open(DOG).convert("RGB"))[260, 400]
    assert np.abs(np.asarray(shown[:3], dtype=int) - expected.astype(int)).max() <= 8

    # Top-5 labels beside the image: the server's own answer for this photo.
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        top5 = c.post("/v1/classify", files={"image": ("dog.jpg", DOG.read_bytes())}).json()
    expect(page.locator("#labels li")).to_have_count(5)
    labels = page.locator("#labels li .label").all_inner_texts()
    assert labels == [p["label"] for p in top5["predictions"]]

    # A left click: the overlay is exactly the best mask the server sent.
    point = screen_point(page, 400, 260)
    first = answer_of(page, "/v1/segment", lambda: page.mouse.click(*point))
    best = decode(first["results"][0]["masks"][0]["segmentation"])
    after_point = covered(page)
    assert after_point.any()
    np.testing.assert_array_equal(after_point, best)
    body = sent_json(calls)[-1]
    assert body["image_id"] == image_id
    assert body["point_coords"] == [[400, 260]] and body["point_labels"] == [1]
    assert body["multimask_output"] is False
    assert "segment" in page.locator("#timing").inner_text()

    # A dragged box joins the point; the overlay changes to the new answer.
    start, end = screen_point(page, 150, 120), screen_point(page, 560, 500)

    def drag() -> None:
        page.mouse.move(*start)
        page.mouse.down()
        page.mouse.move(*end, steps=6)
        page.mouse.up()

    boxed = answer_of(page, "/v1/segment", drag)
    body = sent_json(calls)[-1]
    assert body["point_coords"] == [[400, 260]]
    assert body["box"] == pytest.approx([150, 120, 560, 500], abs=2)
    after_box = covered(page)
    np.testing.assert_array_equal(
        after_box, decode(boxed["results"][0]["masks"][0]["segmentation"])
    )
    assert (after_box != after_point).any()

    # Undo goes back to the point's mask without asking the server again.
    sent = len(sent_json(calls))
    page.click("#undo")
    np.testing.assert_array_equal(covered(page), after_point)
    assert len(sent_json(calls)) == sent

    # Three candidates; picking the third shows it, and the PNG download is that mask.
    multi = answer_of(page, "/v1/segment", lambda: page.check("#multimask"))
    assert sent_json(calls)[-1]["multimask_output"] is True
    candidates = page.locator("#masks .candidate")
    expect(candidates).to_have_count(3)
    third = decode(multi["results"][0]["masks"][2]["segmentation"])
    candidates.nth(2).click()
    expect(candidates.nth(2)).to_have_attribute("aria-pressed", "true")
    np.testing.assert_array_equal(covered(page), third)
    with page.expect_download() as download:
        page.click("#download")
    png = tmp_path / download.value.suggested_filename
    download.value.save_as(png)
    assert png.name == "dog-mask.png"
    np.testing.assert_array_equal(np.asarray(Image.open(png).convert("L")) > 127, third)
    page.screenshot(path=str(tmp_path / "page-prompts.png"))

    # Segment everything: many masks in distinct colours. Random weights predict low IoUs
    # and whole-image boxes, so the filters are opened as the settings hint says.
    page.click(".settings summary")
    page.fill("#pps", "4")
    page.fill("#iou-thresh", "0")
    page.fill("#stability-thresh", "0")
    page.fill("#nms-thresh", "1")
    everything = answer_of(page, "/v1/segment/everything", lambda: page.click("#everything"))
    sent_fields = sent_json(calls, "/v1/segment/everything")
    assert sent_fields[-1]["image_id"] == image_id
    assert sent_fields[-1]["points_per_side"] == 4
    assert len(everything["masks"]) >= 3
    colours = [n for n in page.evaluate(COLORS_JS, "mask-canvas") if n >= 50]
    assert len(colours) >= 3, f"only {len(colours)} colours on the canvas"
    expect(page.locator("#masks li")).to_have_count(min(len(everything["masks"]), 101))
    expect(page.locator("#download")).to_be_disabled()
    assert "everything" in page.locator("#timing").inner_text()
    expect(page.locator("#errors")).to_be_hidden()
    page.screenshot(path=str(tmp_path / "page-everything.png"))

    # Clear empties the overlay.
    page.click("#clear")
    assert not covered(page).any()
    # Back to prompts (three candidates still on) for the picture a reviewer looks at.
    answer_of(page, "/v1/segment", lambda: page.mouse.click(*point))
    page.screenshot(path="/tmp/page.png")


def test_dropped_image_and_refining_clicks(page: Page, live_server: LiveServer) -> None:
    """A dropped file opens; each click sends the previous mask's low-res handle back.

    Right click and the "Background points" toggle both give background points.
    """
    calls = record_calls(page)
    page.goto(live_server.url + "/")
    page.evaluate(DROP_JS, base64.b64encode(DOG.read_bytes()).decode())
    expect(page.locator("#labels li")).to_have_count(5)
    answers = [
        answer_of(page, "/v1/segment", lambda: page.mouse.click(*screen_point(page, 400, 260)))
    ]
    right = screen_point(page, 650, 150)
    answers.append(answer_of(page, "/v1/segment", lambda: page.mouse.click(*right, button="right")))
    page.click("#bg-toggle")
    expect(page.locator("#bg-toggle")).to_have_attribute("aria-pressed", "true")
    left = screen_point(page, 100, 450)
    answers.append(answer_of(page, "/v1/segment", lambda: page.mouse.click(*left)))
    bodies = sent_json(calls)
    assert [b["point_labels"] for b in bodies] == [[1], [1, 0], [1, 0, 0]]
    assert all(b["return_low_res_logits"] is True for b in bodies)
    handles = [a["results"][0]["masks"][0].get("low_res_handle") for a in answers]
    assert all(handles), "the server sent no low_res_handle"
    assert "mask_input" not in bodies[0]
    assert [b["mask_input"] for b in bodies[1:]] == handles[:2]
    np.testing.assert_array_equal(
        covered(page), decode(answers[-1]["results"][0]["masks"][0]["segmentation"])
    )
    expect(page.locator("#errors")).to_be_hidden()


def test_js_rle_decoder_matches_pycocotools(page: Page, live_server: LiveServer) -> None:
    """The page's decoder against pycocotools, on served masks and on awkward ones."""
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        served = c.post(
            "/v1/segment",
            files={"image": ("dog.jpg", DOG.read_bytes())},
            data={"request": '{"boxes": [[70, 250, 560, 530], [600, 10, 790, 300]], '
                  '"multimask_output": true}'},
        )  # fmt: skip
    assert served.status_code == 200, served.text
    rles = [m["segmentation"] for r in served.json()["results"] for m in r["masks"]]
    synthetic = [
        np.zeros((7, 5), bool),  # one run of zeros
        np.ones((5, 7), bool),  # an empty first run, then ones
        np.eye(9, 4, dtype=bool),
        rng.random((37, 53)) < 0.5,  # many short runs: negative deltas
        rng.random((64, 3)) < 0.05,
    ]
    big = np.zeros((1500, 1100), bool)  # long runs: counts of five and six characters
    big[200:1400, 300:900] = True
    big[0:3, 1099] = True
    synthetic.append(big)
    for m in synthetic:
        rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
        rles.append({"size": rle["size"], "counts": rle["counts"].decode()})
    page.goto(live_server.url + "/")
    decoded = page.evaluate(DECODE_JS, rles)
    assert len(decoded) == len(rles)
    for rle, got in zip(rles, decoded, strict=True):
        h, w = rle["size"]
        mine = np.frombuffer(base64.b64decode(got), dtype=np.uint8).reshape(h, w)
        np.testing.assert_array_equal(mine.astype(bool), decode(rle))


def test_api_key_page_explains_401_until_the_key_is_saved(
    page: Page, make_server: Callable[..., LiveServer]
) -> None:
    """Readable 401s (no key, then a wrong key); the right key makes everything work."""
    server = make_server(api_key="page-secret")
    calls = record_calls(page)
    open_dog(page, server)
    errors = page.locator("#errors")
    expect(errors).to_contain_text("Encoding the image (HTTP 401) failed")
    expect(errors).to_contain_text('needs an API key. Enter it in the "API key" field')
    assert covered(page, "image-canvas").all()  # the photo shows even so

    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    expect(errors).to_contain_text("refused the API key you saved")

    page.fill("#api-key", "page-secret")
    page.click("#key-form button")
    expect(page.locator("#labels li")).to_have_count(5)
    expect(page.locator("#random-warning")).to_be_visible()
    expect(errors).to_be_hidden()
    answer_of(page, "/v1/segment", lambda: page.mouse.click(*screen_point(page, 400, 260)))
    assert covered(page).any()
    assert calls[-1].headers.get("x-api-key") == "page-secret"
    assert page.evaluate("() => Object.values(sessionStorage)") == ["page-secret"]

    page.reload()  # the key stays with the tab
    expect(page.locator("#api-key")).to_have_value("page-secret")
    expect(page.locator("#models li")).to_have_count(2)
    expect(errors).to_be_hidden()


def test_an_image_over_the_pixel_limit_is_explained(
    page: Page, live_server: LiveServer, tmp_path: Path
) -> None:
    """A 413 reads as "too large", and the page keeps working for the next image."""
    limit = live_server.settings.max_image_pixels
    side = int(limit**0.5) + 64
    huge = tmp_path / "huge.png"
    huge.write_bytes(encode(Image.new("RGB", (side, side), (40, 90, 160)), "PNG"))
    page.goto(live_server.url + "/")
    page.set_input_files("#file-input", huge)
    errors = page.locator("#errors")
    expect(errors).to_contain_text("HTTP 413")
    expect(errors).to_contain_text("the image is too large for the server")
    page.set_input_files("#file-input", DOG)
    expect(page.locator("#labels li")).to_have_count(5)
    expect(errors).to_be_hidden()


@pytest.mark.timeout(SYNTHETIC_TIMEOUT_S)
def test_synthetic_weights_show_an_honest_note(
    page: Page, make_server: Callable[..., LiveServer], synthetic_checkpoint: tuple[Path, Any]
) -> None:
    """SAM on synthetic weights (tests/conftest.py): the page says they draw shapes, not
    objects; the random-weights warning names only Swin, still random."""
    server = make_server(sam_checkpoint=synthetic_checkpoint[0])
    page.goto(server.url + "/")
    note = page.locator("#synthetic-note")
    expect(note).to_be_visible()
    expect(note).to_contain_text("shapes, not objects")
    expect(note).to_contain_text("sam_vit_tiny runs with synthetic weights")
    expect(page.locator("#models")).to_contain_text("weights: synthetic")
    expect(page.locator("#models li.synthetic")).to_have_count(1)
    warning = page.locator("#random-warning-text")
    expect(warning).to_have_text(
        "swin_test runs with seeded random weights (no checkpoint configured)."
    )


def test_every_image_call_names_the_image_and_a_forgotten_one_is_sent_again(
    page: Page, make_server: Callable[..., LiveServer]
) -> None:
    """X-Image-Id (the SHA-256 the page computes) on every call on the image; a click that
    finds the embedding gone (404: evicted here, a moved replica behind a proxy) embeds the
    image again, once, and the click succeeds."""
    server = make_server(embedding_cache_bytes=256 * 16 * 16 * 4)  # room for one vit_tiny
    dog_id = hashlib.sha256(DOG.read_bytes()).hexdigest()
    calls = record_calls(page)
    with page.expect_response(lambda r: r.url.endswith("/v1/embed")):
        open_dog(page, server)
    expect(page.locator("#labels li")).to_have_count(5)
    other = encode(Image.new("RGB", (64, 48), (200, 30, 30)))
    with httpx.Client(base_url=server.url, timeout=60) as c:  # takes the only cache slot
        assert c.post("/v1/embed", files={"image": ("o.jpg", other)}).status_code == 200
    point = screen_point(page, 400, 260)
    with page.expect_response(lambda r: r.url.endswith("/v1/segment") and r.ok):
        page.mouse.click(*point)
    wait_idle(page)
    assert covered(page).any()
    expect(page.locator("#errors")).to_be_hidden()
    sent = [(r.url.split("/v1/")[1], r.headers.get("x-image-id")) for r in calls]
    assert sorted(sent[:3]) == [("classify", dog_id), ("embed", dog_id), ("models", None)]
    # the click (404), the image again, the click again
    assert sent[3:] == [("segment", dog_id), ("embed", dog_id), ("segment", dog_id)]
