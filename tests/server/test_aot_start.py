"""SERVE_COMPILE_MODE=aot on the CPU, end to end: `python -m server compile` builds the
packages, a server started on the same folder loads them (no build) and answers as the
eager server does on the same weights. SAM and Swin; SAM 2 (its encoder's package, the
decoder eager) on its own.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx

from .conftest import ROOT, encode, photo_like

AOT = {
    "max_batch_size": 1,
    "classify_max_batch_size": 1,
    "batch_buckets": [1],
    "decoder_max_batch_prompts": 4,
}


def _compile(folder: Path, **env_overrides: str) -> str:
    """`python -m server compile` into `folder` with the AOT settings; its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    env.update({
        "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny", "SERVE_SWIN_MODEL": "swin_test",
        "SERVE_COMPILE_MODE": "aot", "SERVE_COMPILE_CACHE_DIR": str(folder),
        "SERVE_MAX_BATCH_SIZE": "1", "SERVE_BATCH_BUCKETS": "[1]",
        "SERVE_DECODER_MAX_BATCH_PROMPTS": "4", "SERVE_CLASSIFY_MAX_BATCH_SIZE": "1",
        **env_overrides,
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "server", "compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def _started_from_packages(make_server, folder: Path, caplog, count: int, **overrides: object):
    """A server on `folder`'s packages, each of the `count` loaded, none built."""
    with caplog.at_level(logging.INFO, logger="models.aot"):
        server = make_server(compile_mode="aot", compile_cache_dir=folder, **AOT, **overrides)
    prepared = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AOT ")]
    assert len(prepared) == count and all(": loaded in" in m for m in prepared), prepared
    return server


def test_compile_then_a_start_loads_the_packages(make_server, tmp_path, caplog):
    stderr = _compile(tmp_path)
    assert stderr.count("building (no package yet)") == 2, stderr  # SAM and Swin
    assert "start-up 5 of 5" in stderr
    assert len(list(tmp_path.rglob("*.pt2"))) == 2

    aot = _started_from_packages(make_server, tmp_path, caplog, 2)
    eager = make_server(**AOT)

    image = base64.b64encode(encode(photo_like(160, 120, seed=5), "PNG")).decode()
    answers = []
    for server in (aot, eager):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            classify = c.post("/v1/classify", json={"image": image, "top_k": 5})
            segment = c.post("/v1/segment", json={"image": image, "box": [10, 10, 90, 80]})
            modes = {m["compile_mode"] for m in c.get("/v1/models").json()["models"]}
        assert classify.status_code == 200 and segment.status_code == 200, segment.text
        assert modes == {"aot" if server is aot else "none"}
        answers.append((classify.json()["predictions"], segment.json()["results"]))
    (aot_top, aot_masks), (eager_top, eager_masks) = answers
    assert [p["index"] for p in aot_top] == [p["index"] for p in eager_top]
    for a, e in zip(aot_top, eager_top, strict=True):
        assert abs(a["score"] - e["score"]) < 1e-4
    aot_scores = [m["score"] for m in aot_masks[0]["masks"]]
    eager_scores = [m["score"] for m in eager_masks[0]["masks"]]
    assert max(abs(a - e) for a, e in zip(aot_scores, eager_scores, strict=True)) < 1e-3


def test_sam2_compiles_its_encoder_and_serves_from_the_package(make_server, tmp_path, caplog):
    """SAM 2: one package, its encoder's (`Sam2Encoder`: the embedding and both high-res
    maps); the decoder runs eagerly. A box and then a click refining its answer give the
    eager server's masks; segment everything runs."""
    sam2 = {"sam_model": "sam2_test_tiny", "enable_swin": False}
    stderr = _compile(tmp_path, SERVE_SAM_MODEL="sam2_test_tiny", SERVE_ENABLE_SWIN="false")
    assert stderr.count("building (no package yet)") == 1, stderr
    assert "AOT sam2_encoder (1, 3, 256, 256): built in" in stderr, stderr
    assert [p.name for p in tmp_path.rglob("*.pt2")] == ["sam2_encoder-Nx3x256x256.pt2"]

    aot = _started_from_packages(make_server, tmp_path, caplog, 1, **sam2)
    eager = make_server(**AOT, **sam2)
    image = base64.b64encode(encode(photo_like(160, 120, seed=6), "PNG")).decode()
    answers = []
    for server in (aot, eager):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            box = c.post("/v1/segment", json={
                "image": image, "box": [10, 10, 90, 80], "return_low_res_logits": True,
            })  # fmt: skip
            assert box.status_code == 200, box.text
            first = box.json()["results"][0]
            click = c.post("/v1/segment", json={
                "image_id": box.json()["image_id"], "point_coords": [[50, 40]],
                "point_labels": [1], "mask_input": first["masks"][0]["low_res_handle"],
            })  # fmt: skip
            assert click.status_code == 200, click.text
            everything = c.post("/v1/segment/everything", json={"image": image})
            assert everything.status_code == 200, everything.text
            models = c.get("/v1/models").json()["models"]
        assert {m["compile_mode"] for m in models} == {"aot" if server is aot else "none"}
        answers.append([r["masks"] for r in (first, click.json()["results"][0])])
    for aot_masks, eager_masks in zip(*answers, strict=True):
        for a, e in zip(aot_masks, eager_masks, strict=True):
            assert abs(a["score"] - e["score"]) < 1e-3
            assert a["area"] == e["area"] or abs(a["area"] - e["area"]) <= 0.01 * e["area"]
