"""How an engine's threads wait for the GPU: spinning on a core, or asleep until it is done.

Why this matters: a thread that waits for its stream (`stream.synchronize()`, a copy to
the host) does so the way its CUDA context's scheduling flag says. CUDA's own default
spins: the thread keeps a core busy polling until the GPU finishes. An engine has a
waiting thread per stage (SAM encoder, decoder, Swin, segment everything, the nvJPEG
decode), and several engines share a GPU, so on a host of 16 cores a dozen of them can
spin at once and starve the frontends, which parse the requests on the same cores.

Measured (H200, 16 cores, 2026-11-27, docs/BENCHMARKS.md issue 19, twentieth session):
`python -m bench.cuda_wait --processes 6 --threads 3` kept 15.8 cores busy spinning, 16.8
yielding and 1.9 blocking. In the service with six engines, random weights, the same
machine, blocking against spinning: classify @2,000/s 1,822 ok/s without an error
against 1,518 with 2,243 timeouts; the mix's p99s 114 / 60 / 76 ms against 183 / 108 /
119; click @100 p50 6.2 against 6.5 ms (the later wake-up costs nothing visible). So
`auto`, the default, is `blocking`.

`SERVE_CUDA_WAIT`: `auto` (blocking), `spin` (CUDA's own default: poll on a core),
`yield` (spin, but give the core to any other ready thread at each poll) or `blocking`
(sleep on an interrupt: no core used while waiting, a wake-up of tens of microseconds
more). The flag belongs to the device's primary context, which PyTorch uses, and must be
set before that context is made: the driver API is called through ctypes (PyTorch has no
call for it), right after the engine process starts and before anything touches CUDA.
"""

from __future__ import annotations

import ctypes
from typing import Literal

__all__ = ["FLAGS", "CudaWait", "cuda_wait_mode", "set_cuda_wait"]

CudaWait = Literal["spin", "yield", "blocking"]
# CUctx_flags' scheduling bits (cuda.h): CU_CTX_SCHED_SPIN, _YIELD, _BLOCKING_SYNC
FLAGS: dict[str, int] = {"spin": 0x01, "yield": 0x02, "blocking": 0x04}


def cuda_wait_mode(setting: str) -> CudaWait:
    """The mode a `SERVE_CUDA_WAIT` value gives: `auto` is blocking (measured above)."""
    if setting == "auto":
        return "blocking"
    if setting not in FLAGS:
        raise ValueError(f"SERVE_CUDA_WAIT={setting!r}: one of auto, spin, yield, blocking")
    return setting  # type: ignore[return-value]


def set_cuda_wait(mode: CudaWait, ordinal: int = 0) -> str | None:
    """Give device `ordinal`'s primary context the scheduling flag `mode`; None when set,
    else why not (no driver, a failing call), for the log: the engine then runs with
    CUDA's default, as before."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return f"no CUDA driver ({error})"
    device = ctypes.c_int()
    for step, call in (
        ("cuInit", lambda: cuda.cuInit(0)),
        ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(device), ordinal)),
        ("cuDevicePrimaryCtxSetFlags",
         lambda: cuda.cuDevicePrimaryCtxSetFlags(device, FLAGS[mode])),
    ):  # fmt: skip
        code = call()
        if code != 0:
            return f"{step} returned CUDA error {code}"
    return None
