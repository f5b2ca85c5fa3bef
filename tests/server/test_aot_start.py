"""SERVE_COMPILE_MODE=aot on the CPU, end to end: `python -m server compile` builds the
packages, a server started on the same folder loads them (no build) and answers as the
eager server does on the same weights.
"""

from __future__ import annotations

import base64
import logging
import os
import subprocess
import sys

import httpx

from .conftest import ROOT, encode, photo_like

AOT = {
    "max_batch_size": 1,
    "classify_max_batch_size": 1,
    "batch_buckets": [1],
    "decoder_max_batch_prompts": 4,
}


def test_compile_then_a_start_loads_the_packages(make_server, tmp_path, caplog):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVE_")}
    env.update({
        "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny", "SERVE_SWIN_MODEL": "swin_test",
        "SERVE_COMPILE_MODE": "aot", "SERVE_COMPILE_CACHE_DIR": str(tmp_path),
        "SERVE_MAX_BATCH_SIZE": "1", "SERVE_BATCH_BUCKETS": "[1]",
        "SERVE_DECODER_MAX_BATCH_PROMPTS": "4", "SERVE_CLASSIFY_MAX_BATCH_SIZE": "1",
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "server", "compile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("building (no package yet)") == 2, done.stderr  # SAM and Swin
    assert "start-up 5 of 5" in done.stderr
    assert len(list(tmp_path.rglob("*.pt2"))) == 2

    with caplog.at_level(logging.INFO, logger="models.aot"):
        aot = make_server(compile_mode="aot", compile_cache_dir=tmp_path, **AOT)
    prepared = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AOT ")]
    assert len(prepared) == 2 and all(": loaded in" in m for m in prepared), prepared
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
