"""Start-up says what it is doing: a log line per step, and /readyz's body while warming.

Real servers on the CPU; `fault_step_delay_s` stretches each step so a poll sees it run.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from server.engine.services import Engine

from .conftest import small_settings

EAGER_PLAN = [
    "loading SAM vit_tiny (random weights)",
    "loading Swin swin_test (random weights)",
    "checking the SAM encoder, batch 1",
    "checking the SAM decoder, 1 prompts",
    "checking Swin, batch 1",
]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def startup_log() -> Iterator[Lines]:
    logger = logging.getLogger("server.startup")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_readyz_shows_the_progress_while_warming(make_server, startup_log):
    server = make_server(wait_ready=False, fault_step_delay_s=0.6)
    seen: list[dict] = []
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "never ready"
        r = httpx.get(server.url + "/readyz", timeout=5)
        if r.status_code == 200:
            break
        assert r.status_code == 503
        body = r.json()
        assert body["error"]["code"] == "not_ready"  # the error envelope, as before
        if "progress" in body:
            seen.append(body["progress"])
        time.sleep(0.1)
    assert len({p["step"] for p in seen}) >= 3, seen  # ~0.6 s per step, polled every 0.1 s
    for before, after in itertools.pairwise(seen):
        assert after["step"] >= before["step"]
        assert after["seconds"] >= before["seconds"]
    for progress in seen:
        assert progress["of"] == len(EAGER_PLAN)
        assert progress["doing"] == EAGER_PLAN[progress["step"] - 1]
    # and the log: one line per step, in order, with n of m and the seconds so far
    messages = [r.getMessage() for r in startup_log.records]
    assert len(messages) == len(EAGER_PLAN), messages
    for n, (message, step) in enumerate(zip(messages, EAGER_PLAN, strict=True), start=1):
        pattern = rf"start-up {n} of {len(EAGER_PLAN)}: {re.escape(step)} \(\d+\.\ds since process"
        assert re.match(pattern, message), message


def test_a_compiled_start_warms_every_bucket_and_an_eager_one_a_batch_per_stage():
    """Compiled code is made per shape, eager code is not: warm-up follows (no model is
    loaded to plan it)."""
    eager = Engine(small_settings())
    compiled = Engine(small_settings(compile_mode="default"))
    try:
        assert [label for label, _ in eager.load_steps() + eager.warm_steps()] == EAGER_PLAN
        labels = [label for label, _ in compiled.warm_steps()]
        # buckets [1, 2, 4] up to max_batch_size 4; decoder up to 32 prompts
        assert labels == [
            *(f"compiling the SAM encoder, batch {b}" for b in (1, 2, 4)),
            *(f"compiling the SAM decoder, {b} prompts" for b in (1, 2, 4, 32)),
            *(f"compiling Swin, batch {b}" for b in (1, 2, 4)),
        ]
    finally:
        eager.worker.shutdown()
        compiled.worker.shutdown()
