"""SAM 2.1 through the real server (`SERVE_SAM_MODEL=sam2_test_tiny`, 256 px, seeded random
weights on the CPU): embed, segment with points and boxes, clicks on a cached embedding,
refinement handles, the embedding download (an `.npz` a decoder clicks on), concurrent
requests on photos of two sizes batched together, and the served masks against
`models.sam2`'s own `Sam2.decode` on the same weights and pixels.

The checkpoint path: seeded weights saved in Meta's release format (`{"model": ...}`, Meta's
key names, video keys beside) start `python -m server` and answer like the model they hold;
a wrong file stops start-up with the loader's message.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils

from models.sam2 import SAM2_CONFIGS, Sam2, Sam2Features, load_sam2
from models.sam2 import transforms as sam2_tf
from server.client import Client
from server.imaging import decode_image, square_min_size
from server.settings_cli import BadSettingError, load_settings
from tests.conftest import PHOTOS

from .conftest import (
    LiveServer,
    free_port,
    small_settings,
    spawn_server,
    stop_server,
    wait_until_ready,
)

MODEL = "sam2_test_tiny"
CONFIG = SAM2_CONFIGS[MODEL]
DOG = (PHOTOS / "dog.jpg").read_bytes()  # 800 x 534
TRUCK = (PHOTOS / "truck.jpg").read_bytes()  # 900 x 600


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # a long queue delay, so concurrent requests meet in one encoder and decoder batch;
    # photos decoded whole, so the model on the whole decode is the exact reference (the
    # scaled decode, the default, has its own test below)
    settings = small_settings(
        sam_model=MODEL, enable_swin=False, max_queue_delay_ms=150.0, scaled_decode=False
    )
    live = LiveServer(settings).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model() -> Sam2:
    return load_sam2(CONFIG, None, seed=0)  # the server's weights (SERVE_SEED 0)


def pixels(data: bytes) -> np.ndarray:
    """The pixels the server sees: its own decoder, whole (see the `server` fixture)."""
    return decode_image(data, max_pixels=10**8, max_bytes=10**8).pixels


def segment(http: httpx.Client, data: bytes | None = None, **fields: Any) -> dict[str, Any]:
    if data is not None:
        files = {"image": ("photo.jpg", data, "image/jpeg")}
        r = http.post("/v1/segment", files=files, data={"request": json.dumps(fields)})
    else:
        r = http.post("/v1/segment", json=fields)
    assert r.status_code == 200, r.text
    return r.json()


def masks_of(body: dict[str, Any], result: int = 0) -> np.ndarray:
    """`[K, H, W]` bool masks of one result, as served (best score first)."""
    return np.stack(
        [
            mask_utils.decode({"size": m["segmentation"]["size"],
                               "counts": m["segmentation"]["counts"].encode()}).astype(bool)
            for m in body["results"][result]["masks"]
        ]
    )  # fmt: skip


def scores_of(body: dict[str, Any], result: int = 0) -> list[float]:
    return [m["score"] for m in body["results"][result]["masks"]]


@torch.inference_mode()
def reference(
    model: Sam2,
    image: np.ndarray,
    points: list[list[float]] | None = None,
    labels: list[int] | None = None,
    box: list[float] | None = None,
    multimask: bool = False,
    mask_input: torch.Tensor | None = None,
    original_size: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """`models.sam2` alone: masks `[K, H, W]` and scores best first, and the clamped
    low-res logits `[K, m, m]` in that order (what a refinement handle holds). Prompts and
    masks are in the photo's frame, `original_size` when the pixels are a scaled decode."""
    hw = original_size or (int(image.shape[0]), int(image.shape[1]))
    features = model.encode(sam2_tf.preprocess_image(image, CONFIG))
    return decoded(model, features, hw, points, labels, box, multimask, mask_input)


@torch.inference_mode()
def decoded(
    model: Sam2,
    features: Sam2Features,
    hw: tuple[int, int],
    points: list[list[float]] | None = None,
    labels: list[int] | None = None,
    box: list[float] | None = None,
    multimask: bool = False,
    mask_input: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """`reference`'s answer from given features (of an image of size `hw`)."""
    pts = lab = bxs = None
    if points is not None:
        pts = sam2_tf.scale_points(torch.tensor([points], dtype=torch.float32), hw, CONFIG)
        lab = torch.tensor([labels])
    if box is not None:
        bxs = sam2_tf.scale_boxes(torch.tensor([box], dtype=torch.float32), hw, CONFIG)
    pred = model.decode(features, pts, lab, bxs, mask_input, multimask)
    masks, low_res = sam2_tf.postprocess_masks(pred.low_res_masks, hw, CONFIG)
    order = pred.iou[0].argsort(descending=True, stable=True)
    return masks[0, order].numpy(), pred.iou[0, order].numpy(), low_res[0, order]


def assert_same_masks(served: np.ndarray, expected: np.ndarray, tolerance: float = 1e-5) -> None:
    """Equal but for a pixel or two whose logit sits within rounding of the threshold
    (on the CPU none differed: same ops, same order)."""
    assert served.shape == expected.shape
    for s, e in zip(served, expected, strict=True):
        assert e.sum() > 0 and (~e).sum() > 0, "a degenerate mask proves nothing"
        assert (s != e).mean() <= tolerance, f"{(s != e).sum()} pixels differ"


def test_models_and_page_name_sam2(http: httpx.Client) -> None:
    body = http.get("/v1/models").json()
    (sam,) = body["models"]
    assert sam["name"] == MODEL
    assert sam["weights"] == "random"
    assert sam["precision"] == "fp32" and sam["device"] == "cpu"
    page = http.get("/")
    assert page.status_code == 200 and "models" in page.text


def test_segment_click_and_box_equal_the_model(http: httpx.Client, model: Sam2) -> None:
    image = pixels(DOG)
    click = {"point_coords": [[400, 250]], "point_labels": [1], "multimask_output": True}
    body = segment(http, DOG, **click)
    assert (body["width"], body["height"]) == (800, 534)
    assert body["model"]["name"] == MODEL
    masks, scores, _ = reference(model, image, [[400, 250]], [1], multimask=True)
    assert_same_masks(masks_of(body), masks)
    np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)

    box = {"box": [120, 60, 560, 470], "point_coords": [[300, 300]], "point_labels": [0]}
    body = segment(http, DOG, **box)
    masks, scores, _ = reference(model, image, [[300, 300]], [0], [120, 60, 560, 470])
    assert_same_masks(masks_of(body), masks)
    np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)


def test_click_on_a_cached_embedding(http: httpx.Client, model: Sam2) -> None:
    r = http.post("/v1/embed", files={"image": ("truck.jpg", TRUCK, "image/jpeg")})
    assert r.status_code == 200, r.text
    embedded = r.json()
    assert (embedded["width"], embedded["height"]) == (900, 600)
    body = segment(http, image_id=embedded["image_id"], point_coords=[[450, 320]], point_labels=[1])
    assert body["image_id"] == embedded["image_id"]
    masks, scores, _ = reference(model, pixels(TRUCK), [[450, 320]], [1])
    assert_same_masks(masks_of(body), masks)  # single mask: SAM 2's stability fallback
    np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)


def test_refinement_with_a_handle(http: httpx.Client, model: Sam2) -> None:
    image = pixels(DOG)
    first = segment(http, DOG, point_coords=[[200, 150]], point_labels=[1],
                    multimask_output=True, return_low_res_logits=True)  # fmt: skip
    handles = [m["low_res_handle"] for m in first["results"][0]["masks"]]
    assert len(handles) == 3 and all(handles)
    # the second click, with the best mask's low-res logits, as Meta's predictor loop does
    _, _, low_res = reference(model, image, [[200, 150]], [1], multimask=True)
    refined = segment(http, image_id=first["image_id"], point_coords=[[200, 150], [500, 300]],
                      point_labels=[1, 0], mask_input=handles[0])  # fmt: skip
    masks, scores, _ = reference(
        model, image, [[200, 150], [500, 300]], [1, 0], mask_input=low_res[:1][None]
    )
    assert_same_masks(masks_of(refined), masks)
    np.testing.assert_allclose(scores_of(refined), scores, atol=1e-4)
    # the previous round's logits alone, no click (an empty point list, as Meta's predictor)
    alone = segment(http, image_id=first["image_id"], mask_input=handles[2])
    masks, scores, _ = reference(model, image, mask_input=low_res[2:3][None])
    assert_same_masks(masks_of(alone), masks)
    np.testing.assert_allclose(scores_of(alone), scores, atol=1e-4)
    # a handle on another image is refused, as for SAM
    truck_id = http.post("/v1/embed", files={"image": ("t.jpg", TRUCK, "image/jpeg")}).json()
    r = http.post("/v1/segment", json={"image_id": truck_id["image_id"], "point_coords":
                  [[10, 10]], "point_labels": [1], "mask_input": handles[1]})  # fmt: skip
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


def _decoder_batches(http: httpx.Client) -> tuple[float, float]:
    """(items, batches) the decoder's batcher has run so far, from /metrics."""
    text = http.get("/metrics").text
    found = {}
    for what in ("sum", "count"):
        match = re.search(
            rf'serve_batch_size_{what}{{[^}}]*stage="sam_decoder"[^}}]*}} (\S+)', text
        )
        assert match, text
        found[what] = float(match.group(1))
    return found["sum"], found["count"]


def test_concurrent_requests_on_two_photos_equal_each_alone(http: httpx.Client) -> None:
    """Requests on two photos of different sizes, sent at once, meet in shared encoder and
    decoder batches (a box request, a multimask click, two boxes at once, a refinement-free
    click pair): each answer equals the same request sent alone afterwards."""
    requests = [
        (DOG, {"point_coords": [[100, 400]], "point_labels": [1], "multimask_output": True}),
        (TRUCK, {"box": [100, 100, 700, 500]}),
        (DOG, {"boxes": [[10, 10, 300, 300], [400, 200, 790, 520]]}),
        (TRUCK, {"point_coords": [[600, 200], [200, 450]], "point_labels": [1, 0]}),
        (DOG, {"box": [50, 60, 700, 500], "point_coords": [[350, 280]], "point_labels": [1]}),
        (TRUCK, {"point_coords": [[880, 590]], "point_labels": [1], "multimask_output": True}),
    ]
    items_before, batches_before = _decoder_batches(http)
    # fresh images each: a byte appended after the JPEG's end changes the id, not the pixels
    tagged = [(data + bytes([n]), fields) for n, (data, fields) in enumerate(requests)]
    with ThreadPoolExecutor(len(tagged)) as pool:
        together = list(pool.map(lambda r: segment(http, r[0], **r[1]), tagged))
    items, batches = _decoder_batches(http)
    assert items - items_before > batches - batches_before, "no decoder batch held two requests"
    for (_, fields), body in zip(tagged, together, strict=True):
        alone = segment(http, image_id=body["image_id"], **fields)
        assert len(alone["results"]) == len(body["results"]) == len(fields.get("boxes", [0]))
        for n in range(len(body["results"])):
            assert_same_masks(masks_of(body, n), masks_of(alone, n))
            np.testing.assert_allclose(scores_of(body, n), scores_of(alone, n), atol=1e-5)


ENTRY_BYTES = 1024**2  # sam2_test_tiny in fp32: embedding 256 KiB, s0 512 KiB, s1 256 KiB


def test_the_cache_counts_the_high_res_features_and_its_host_tier_keeps_them(
    make_server: Any, model: Sam2
) -> None:
    """A device tier of 1.5 entries holds one image (the embedding alone would let six
    fit); with a host tier the evicted image's features come back whole for a click."""
    device_only = make_server(sam_model=MODEL, enable_swin=False, scaled_decode=False,
                              embedding_cache_bytes=3 * ENTRY_BYTES // 2)  # fmt: skip
    with httpx.Client(base_url=device_only.url, timeout=60) as http:
        dog = http.post("/v1/embed", files={"image": ("d.jpg", DOG, "image/jpeg")}).json()
        http.post("/v1/embed", files={"image": ("t.jpg", TRUCK, "image/jpeg")})
        r = http.post("/v1/segment", json={"image_id": dog["image_id"],
                      "point_coords": [[400, 250]], "point_labels": [1]})  # fmt: skip
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_image_id"
    tiered = make_server(sam_model=MODEL, enable_swin=False, scaled_decode=False,
                         embedding_cache_bytes=3 * ENTRY_BYTES // 2,
                         embedding_cache_host_bytes=4 * ENTRY_BYTES)  # fmt: skip
    with httpx.Client(base_url=tiered.url, timeout=60) as http:
        dog = http.post("/v1/embed", files={"image": ("d.jpg", DOG, "image/jpeg")}).json()
        http.post("/v1/embed", files={"image": ("t.jpg", TRUCK, "image/jpeg")})
        body = segment(http, image_id=dog["image_id"], point_coords=[[400, 250]],
                       point_labels=[1], multimask_output=True)  # fmt: skip
        metrics = http.get("/metrics").text
    host_hits = r'serve_embedding_cache_events_total{[^}]*event="host_hit"[^}]*} 1\.0\n'
    assert re.search(host_hits, metrics), metrics
    masks, scores, _ = reference(model, pixels(DOG), [[400, 250]], [1], multimask=True)
    assert_same_masks(masks_of(body), masks)
    np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)


def test_the_embedding_download_is_an_npz_a_decoder_can_click_on(
    server: LiveServer, http: httpx.Client, model: Sam2
) -> None:
    """The `.npz` holds SAM 2's three decoder inputs under the ONNX decoders' names, in
    float16; `Sam2.decode` on them alone (no encoder) gives the served click's masks, and
    `server.client` reads the file into its `EmbeddingArray`."""
    embedded = http.post("/v1/embed", files={"image": ("t.jpg", TRUCK, "image/jpeg")}).json()
    image_id = embedded["image_id"]
    r = http.get(f"/v1/embeddings/{image_id}")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == f'attachment; filename="{image_id}.npz"'
    assert r.headers["x-original-size"] == "600,900"
    assert r.headers["x-input-size"] == f"{CONFIG.image_size},{CONFIG.image_size}"
    d, h = CONFIG.d_model, CONFIG.embedding_size  # 256 and 16 at 256 px
    expected = {
        "image_embed": (1, d, h, h),
        "high_res_feats_0": (1, d // 8, 4 * h, 4 * h),
        "high_res_feats_1": (1, d // 4, 2 * h, 2 * h),
    }
    with np.load(io.BytesIO(r.content), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    assert {name: a.shape for name, a in arrays.items()} == expected
    assert all(a.dtype == np.float16 and np.isfinite(a).all() for a in arrays.values())

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(arrays[name]).float()

    features = Sam2Features(
        tensor("image_embed"), (tensor("high_res_feats_0"), tensor("high_res_feats_1"))
    )
    click = {"point_coords": [[450, 320]], "point_labels": [1], "multimask_output": True}
    served = segment(http, image_id=image_id, **click)
    masks, scores, _ = decoded(model, features, (600, 900), [[450, 320]], [1], multimask=True)
    for mine, theirs in zip(masks, masks_of(served), strict=True):
        assert mine.any() and (~mine).any(), "a degenerate mask proves nothing"
        assert (mine & theirs).sum() / (mine | theirs).sum() >= 0.98  # fp16 moves a few pixels
    np.testing.assert_allclose(scores, scores_of(served), atol=1e-3)

    with Client(server.url) as client:
        read = client.embedding(image_id)
    assert read.original_size == (600, 900) and read.input_size == (CONFIG.image_size,) * 2
    np.testing.assert_array_equal(read.embedding, arrays["image_embed"])
    for mine, name in zip(read.high_res, ("high_res_feats_0", "high_res_feats_1"), strict=True):
        np.testing.assert_array_equal(mine, arrays[name])

    r = http.get("/v1/embeddings/" + "0" * 64)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_image_id"


def test_settings_accept_sam2_names_and_refuse_unknown_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SERVE_SAM_MODEL", "sam2.1_hiera_b+")
    assert load_settings().sam_model == "sam2.1_hiera_base_plus"
    for short, name in (("t", "tiny"), ("s", "small"), ("l", "large")):
        monkeypatch.setenv("SERVE_SAM_MODEL", f"sam2.1_hiera_{short}")
        assert load_settings().sam_model == f"sam2.1_hiera_{name}"
    monkeypatch.setenv("SERVE_SAM_MODEL", "sam2.1_hiera_huge")
    with pytest.raises(BadSettingError) as bad:
        load_settings()
    message = str(bad.value)
    assert "\n" not in message and "SERVE_SAM_MODEL='sam2.1_hiera_huge'" in message
    for name in ("vit_b", "sam2.1_hiera_tiny", "sam2.1_hiera_large", "sam2.1_hiera_b+"):
        assert name in message
    monkeypatch.setenv("SERVE_SAM_MODEL", "sam2.1_hiera_tiny")
    monkeypatch.setenv("SERVE_QUANTIZATION", "int8")
    with pytest.raises(BadSettingError, match="slower and less faithful than bf16"):
        load_settings()


def save_meta_format(model: Sam2, path: Path) -> Path:
    """Our weights under Meta's keys (`mlp.lin{1,2}` -> `mlp.layers.{0,1}`), with a video
    module's tensor beside them, as `{"model": state_dict}`: the release format."""
    state = {
        re.sub(r"(transformer\.layers\.\d+\.mlp\.)lin([12])\.",
               lambda m: f"{m.group(1)}layers.{int(m.group(2)) - 1}.", key): value
        for key, value in model.state_dict().items()
    }  # fmt: skip
    state["maskmem_tpos_enc"] = torch.zeros(7, 1, 1, 64)
    torch.save({"model": state}, path)
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "sam2.1_hiera_t", "SERVE_ENABLE_SWIN": "false",
        "SERVE_HTTP_WORKERS": "1", "SERVE_BATCH_BUCKETS": "[1,2]", "SERVE_LOG_LEVEL": "INFO",
        "SERVE_SCALED_DECODE": "false",  # the whole decode: `pixels` is the exact reference
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    })  # fmt: skip
    env.update(extra)
    return env


def test_python_m_server_on_meta_format_weights(tmp_path: Path) -> None:
    """`python -m server` with SERVE_SAM_CHECKPOINT at seeded weights saved in Meta's
    format: /v1/models names the file, and a click's masks are those of the saved model."""
    saved = load_sam2(CONFIG, None, seed=7)
    path = save_meta_format(saved, tmp_path / "sam2.1_test_tiny.pt")
    port = free_port()
    log_path = tmp_path / "server.log"
    env = _env(tmp_path, SERVE_SAM_MODEL=MODEL, SERVE_SAM_CHECKPOINT=str(path))
    with log_path.open("w") as log:
        proc = spawn_server(env, port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(proc, url, log_path, 120)
        with httpx.Client(base_url=url, timeout=60) as http:
            (sam,) = http.get("/v1/models").json()["models"]
            assert (sam["name"], sam["weights"]) == (MODEL, path.name)
            body = segment(http, DOG, point_coords=[[400, 250]], point_labels=[1],
                           multimask_output=True)  # fmt: skip
        masks, scores, _ = reference(saved, pixels(DOG), [[400, 250]], [1], multimask=True)
        assert_same_masks(masks_of(body), masks)
        np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)
    finally:
        stop_server(proc, log_path)


def test_a_wrong_checkpoint_stops_start_up_with_its_message(tmp_path: Path) -> None:
    """A SAM 2 file for another size (a released tiny's keys against the test config):
    start-up stops, exit 1, the loader's message in the log and no traceback."""
    wrong = save_meta_format(load_sam2(CONFIG, None, seed=1), tmp_path / "sam2.1_hiera_tiny.pt")
    log_path = tmp_path / "server.log"
    env = _env(tmp_path, SERVE_SAM_CHECKPOINT=str(wrong))  # serving sam2.1_hiera_tiny
    with log_path.open("w") as log:
        proc = spawn_server(env, free_port(), log)
    try:
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert "Sam2CheckpointError" in text and str(wrong) in text, text
    assert "Traceback" not in text, text


def test_a_photo_larger_than_needed_is_decoded_scaled(model: Sam2) -> None:
    """By default the frontend decodes a JPEG only as large as SAM 2's square resize
    needs (both sides at least the input size): the masks are still at the photo's size,
    and equal the model's on those pixels with the prompts in the photo's frame."""
    rule = partial(square_min_size, image_size=CONFIG.image_size)
    scaled = decode_image(DOG, max_pixels=10**8, max_bytes=10**8, min_size=rule)
    assert scaled.scaled and scaled.pixel_size == (400, 267)
    settings = small_settings(sam_model=MODEL, enable_swin=False)
    live = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            click = {"point_coords": [[400, 250]], "point_labels": [1], "multimask_output": True}
            body = segment(http, DOG, **click)
    finally:
        live.stop()
    assert (body["width"], body["height"]) == (800, 534)
    masks, scores, _ = reference(
        model, scaled.pixels, [[400, 250]], [1], multimask=True, original_size=(534, 800)
    )
    assert masks.shape[1:] == (534, 800)
    assert_same_masks(masks_of(body), masks)
    np.testing.assert_allclose(scores_of(body), scores, atol=1e-4)
