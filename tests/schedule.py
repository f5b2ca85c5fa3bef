"""The order in which xdist's workers get the test modules: the slowest first.

`--dist loadscope` keeps a module's tests on one worker, in order, and xdist's own order
hands out the modules with the most tests first. That left the slow modules of one or two
tests to the end: the soak (90 s of traffic) or the AOT start (two compiles, 146 s) ran
alone after the other worker had finished, 100 s of an idle core in a CI-like run
(2026-11-27). Handed out first, longest first, they run beside the rest, and both workers
end on short modules.

Only an order: a stale or missing figure costs time, never a test. Refresh the table from
a CI-like run (`python -m pytest -q -n 2 --durations=0` on two cores with empty compile
caches; a module's setup, call and teardown summed) when a module's time moves by tens
of seconds.
"""

from __future__ import annotations

from collections import Counter

import pytest

# Seconds per module, the modules over 15 s of a CI-like run: two cores, `-n 2`, empty
# compile caches (inductor, Triton), one torch thread a worker (tests/conftest.py).
MODULE_SECONDS: dict[str, int] = {
    "tests/server/test_aot_start.py": 146,
    "tests/models/test_sam2_automatic.py": 98,
    "tests/server/test_soak.py": 96,
    "tests/models/test_mlp_hop.py": 85,
    "tests/models/test_aot.py": 69,
    "tests/models/test_swin_resize_kernel.py": 69,
    "tests/models/test_decoder_attention_kernel.py": 67,
    "tests/models/test_sam_fused_attention.py": 62,
    "tests/server/test_engine.py": 53,
    # trains the synthetic weights that test_page.py and test_synthetic_weights.py read
    "tests/models/test_synthesize.py": 51,
    "tests/models/test_sam2_upscale_kernel.py": 47,
    "tests/models/test_swin_window_kernel.py": 45,
    "tests/models/test_sam2_synthesize.py": 44,
    "tests/server/test_processes.py": 41,
    "tests/models/test_ln_quant.py": 37,
    "tests/deploy/test_affinity.py": 37,
    "tests/models/test_sam_compile.py": 35,
    "tests/server/test_stages_compile.py": 29,
    "tests/models/test_sam2_measure_kernel.py": 28,
    "tests/server/test_engines.py": 28,
    "tests/models/test_sam_automatic.py": 28,
    "tests/server/test_sam2_decoder_graphs.py": 27,
    "tests/server/test_engine_faults.py": 23,
    "tests/server/test_hostile_inputs.py": 22,
    "tests/server/test_page.py": 22,
    "tests/bench/test_openloop.py": 21,
    "tests/server/test_sam2_stages_compile.py": 21,
    "tests/server/test_sam2_everything.py": 20,
    "tests/server/test_fidelity_check.py": 20,
    "tests/models/test_int8_gemm.py": 20,
    "tests/models/test_gemm_persistent.py": 18,
    "tests/server/test_reliability.py": 19,
    "tests/bench/test_frontend_cpu.py": 19,
    "tests/server/test_tracing.py": 17,
    "tests/models/test_quantize.py": 17,
    "tests/deploy/test_locust_smoke.py": 16,
    "tests/server/test_fuzz.py": 15,
    "tests/server/test_sam2_service.py": 15,
    "tests/models/test_fp8_gemm.py": 15,
    "tests/models/test_sam_attention.py": 15,
    "tests/server/test_metrics_multiprocess.py": 15,
    "tests/server/test_http_faults.py": 15,
}


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def slowest_first(items: list[pytest.Item]) -> None:
    """Sort `items` in place: the modules of MODULE_SECONDS longest first, then the others
    by their number of tests, most first (xdist's own order, which `--no-loadscope-reorder`
    turns off so that this one is kept); a module's tests keep their order."""
    counts = Counter(module_of(item) for item in items)

    def key(item: pytest.Item) -> tuple[int, int]:
        module = module_of(item)
        return -MODULE_SECONDS.get(module, 0), -counts[module]

    items.sort(key=key)
