"""bench.int8_compile_check's Swin bisection, on the CPU with the test model: each int8
group swaps the layers it names, and dynamo's graph capture (aot_eager, no code generation)
gives eager's logits exactly, the yardstick the GPU run is read against."""

from __future__ import annotations

import argparse

from bench.int8_compile_check import swin_bisect
from tests.conftest import PHOTOS


def test_the_swin_bisection_swaps_each_group_and_tracing_changes_nothing() -> None:
    args = argparse.Namespace(
        model="swin_test", device="cpu", images=PHOTOS, batch=4,
        groups=["none", "fc1", "all", "mlp"], backends=["aot_eager"],
    )  # fmt: skip
    rows = swin_bisect(args)
    assert [(r["int8"], r["path"]) for r in rows] == [
        ("none", "aot_eager"), ("fc1", "aot_eager"), ("all", "aot_eager"), ("mlp", "aot_eager"),
    ]  # fmt: skip
    layers = {r["int8"]: r["layers"] for r in rows}
    assert layers["none"] == 0 < layers["fc1"] < layers["all"]
    assert layers["mlp"] == 2 * layers["fc1"]
    for row in rows:
        assert row["vs_eager"] == 0.0 and row["top1_vs_eager"] == 1.0, row
    assert rows[0]["eager_vs_bf16"] == 0.0 < rows[2]["eager_vs_bf16"] < 0.05
