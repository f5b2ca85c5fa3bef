"""The README's examples, run as written: its Usage block goes through bash and curl against
`python -m server` (small models on the CPU), and its documented segment response is held
to the real one, key for key and type for type.

Only the address (`localhost:8000`) is rewritten; the photos the examples name sit in the
working folder, copied from tests/photos. Every curl call is recorded (arguments, status,
content type, body) by a shell function in front of the real curl, which also adds
`--fail-with-body`, so an error status fails the script there and then.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import PHOTOS
from tests.server.conftest import ROOT, free_port, spawn_server, stop_server, wait_until_ready

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)

# In front of every curl the examples call: record it, and fail on an error status.
RECORDING_CURL = r"""
set -euo pipefail
curl() {
  local n; n=$(( $(cat "$CALLS/count") + 1 )); echo "$n" > "$CALLS/count"
  printf '%s\n' "$@" > "$CALLS/$n.args"
  local out=(-o "$CALLS/$n.body")
  for arg in "$@"; do if [[ $arg == -o ]]; then out=(); fi; done
  command curl --fail-with-body --show-error --max-time 120 \
    -w '%{http_code} %{content_type}' "${out[@]}" "$@" > "$CALLS/$n.status" || return $?
  if [[ ${#out[@]} -gt 0 ]]; then cat "$CALLS/$n.body"; fi
}
"""


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def fenced(section: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(section) if lang == language]


def readme_test_line() -> str:
    """The README's second set-up command: the one that installs the test tools and tests."""
    (line,) = [ln for ln in fenced(README.read_text(), "bash")[0].splitlines() if "pytest" in ln]
    return line


def test_ci_runs_the_readme_test_line_as_written() -> None:
    """A missing install step shows in CI only if CI installs as the README says; the
    fresh-clone step (tests/test_fresh_clone.py) runs in the virtualenv this line makes."""
    assert readme_test_line() in (ROOT / ".ci" / "run").read_text().splitlines()


def shape(value: Any) -> Any:
    """Keys and types, int told from float; a list by its first element (they are uniform)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m server` as the README starts it, with the small models."""
    folder = tmp_path_factory.mktemp("readme-server")
    env = {**os.environ, "SERVE_DEVICE": "cpu", "SERVE_SAM_MODEL": "vit_tiny",
           "SERVE_SWIN_MODEL": "swin_test", "SERVE_MAX_BATCH_SIZE": "4",
           "SERVE_BATCH_BUCKETS": "[1,2,4]", "SERVE_LOG_LEVEL": "WARNING"}  # fmt: skip
    port = free_port()
    with (folder / "server.log").open("w+") as log:
        proc = spawn_server(env, port, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until_ready(proc, url, folder / "server.log", 240)
            yield url
        finally:
            stop_server(proc, folder / "server.log")


@pytest.fixture(scope="module")
def usage_calls(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run the Usage block once; one record per curl call, in order."""
    assert shutil.which("curl"), "curl is needed (the README's test line installs it)"
    (block,) = fenced(readme_section("Usage"), "bash")
    work = tmp_path_factory.mktemp("readme-usage")
    for name in ("dog.jpg", "truck.jpg"):
        shutil.copy(PHOTOS / name, work / name)
    calls = work / "calls"
    calls.mkdir()
    (calls / "count").write_text("0")
    script = RECORDING_CURL + block.replace("localhost:8000", server_url.removeprefix("http://"))
    # `python` in the examples is this interpreter (the virtualenv's, as after the install)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run(["bash", "-c", script], cwd=work, env={**os.environ, "CALLS": str(calls),
                          "PATH": path}, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"the Usage block failed:\n{proc.stderr[-4000:]}"
    count = int((calls / "count").read_text())
    assert count == block.count("curl "), "every curl in the block ran"
    records = []
    for n in range(1, count + 1):
        args = (calls / f"{n}.args").read_text().splitlines()
        status, _, content_type = (calls / f"{n}.status").read_text().partition(" ")
        body_file = work / args[args.index("-o") + 1] if "-o" in args else calls / f"{n}.body"
        url = next(a for a in args if a.startswith("127.0.0.1:"))
        path = url.split("/", 1)[1] if "/" in url else ""
        records.append({"args": args, "status": int(status), "type": content_type,
                        "path": "/" + path, "body": body_file.read_bytes()})  # fmt: skip
    return records


def by_path(calls: list[dict], prefix: str) -> list[dict]:
    return [c for c in calls if c["path"].startswith(prefix)]


def body(call: dict) -> Any:
    assert call["type"].startswith("application/json"), call
    return json.loads(call["body"])


def test_every_usage_example_succeeds(usage_calls: list[dict]) -> None:
    for call in usage_calls:
        assert 200 <= call["status"] < 300, call
        if call["type"].startswith("application/json"):
            json.loads(call["body"])
    assert by_path(usage_calls, "/metrics")[0]["type"].startswith("text/plain")


def test_segment_examples_give_what_the_readme_says(usage_calls: list[dict]) -> None:
    point, boxes, base64_json, by_id, refine_ask, refine, by_header = (
        body(c) for c in by_path(usage_calls, "/v1/segment") if c["path"] == "/v1/segment"
    )
    assert [len(r["masks"]) for r in point["results"]] == [1]
    assert [len(r["masks"]) for r in boxes["results"]] == [3, 3]  # two boxes, multimask
    assert len(base64_json["results"]) == 1
    assert by_id["image_id"] == point["image_id"]  # the SHA-256 of the same file bytes
    handle = refine_ask["results"][0]["masks"][0]["low_res_handle"]
    assert isinstance(handle, str) and handle
    assert refine["image_id"] == point["image_id"] and len(refine["results"]) == 1
    assert by_header["image_id"] == point["image_id"]  # sha256sum agrees with the server


def test_the_documented_segment_response_is_the_real_one(usage_calls: list[dict]) -> None:
    section = readme_section("Usage")
    documented = json.loads(fenced(section[section.index("A segment response:") :], "json")[0])
    real = body(by_path(usage_calls, "/v1/segment")[0])
    assert shape(real) == shape(documented)
    mask = real["results"][0]["masks"][0]
    assert mask["segmentation"]["size"] == [real["height"], real["width"]]


def test_everything_embedding_and_classify_examples(usage_calls: list[dict]) -> None:
    (everything,) = (body(c) for c in by_path(usage_calls, "/v1/segment/everything"))
    assert set(everything) - {"model", "timing_ms"} == {"image_id", "width", "height", "masks"}
    assert isinstance(everything["masks"], list)  # random weights: Meta's thresholds drop all
    documented_mask = {"segmentation", "score", "area", "bbox"}
    extra = {"stability_score", "point_coords", "crop_box"}
    assert all(set(m) == documented_mask | extra for m in everything["masks"])

    (embedding,) = by_path(usage_calls, "/v1/embeddings/")
    array = np.load(io.BytesIO(embedding["body"]))
    assert array.dtype == np.float16 and array.ndim == 4 and array.shape[:2] == (1, 256)

    (classify,) = (body(c) for c in by_path(usage_calls, "/v1/classify"))
    assert len(classify["predictions"]) == 5  # top_k


def test_the_weights_list_command_runs_as_written() -> None:
    """The Weights block's first command (the download and the served checkpoint after it
    need Meta's servers, which CI cannot reach)."""
    (block, *_) = fenced(readme_section("Weights"), "bash")
    command = block.splitlines()[0]
    assert command == "python -m models.weights list", command
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env={**os.environ, "PATH": path},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "sam_vit_b_01ec64.pth" in proc.stdout
