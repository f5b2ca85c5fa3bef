"""bench.ncu_attention's reading of Nsight Compute's per-instruction CSV.

The data is an excerpt of a real report (H200, 2026-11-29: the global attention layer
capped at 168 registers, then uncapped): both kernels' header rows, their first three
SASS lines and their six most sampled ones, as `ncu --page source --csv --print-source
sass` wrote them.
"""

from __future__ import annotations

from pathlib import Path

from bench.ncu_attention import stalls

EXCERPT = Path(__file__).parent / "data" / "ncu_sass_excerpt.csv"


def test_stalls_are_summed_per_kernel_and_ranked() -> None:
    kernels = stalls(EXCERPT, top=3)
    assert len(kernels) == 2
    for kernel in kernels:
        reasons = kernel["reasons"]
        assert isinstance(reasons, dict)
        # the reasons are shares of every sample, largest first
        assert list(reasons.values()) == sorted(reasons.values(), reverse=True)
        assert 99.0 <= sum(reasons.values()) <= 100.5
        top = kernel["top"]
        assert isinstance(top, list) and len(top) == 3
        shares = [line["share"] for line in top]
        assert shares == sorted(shares, reverse=True)
        # the kernels wait on the tensor cores more than on anything else
        assert top[0]["sass"].startswith("WARPGROUP.DEPBAR")
        assert top[0]["why"] == "barrier"
    assert kernels[0]["samples"] == 26082
    assert kernels[1]["samples"] == 29700
