"""How an engine's threads wait for the GPU: spinning on a core, or asleep until it is done.

Why this matters: a thread that waits for its stream (`stream.synchronize()`, a copy to
the host) does so the way its CUDA context's scheduling flag says. CUDA's default (`auto`)
spins: the thread keeps a core busy polling until the GPU finishes. An engine has a
waiting thread per stage (SAM encoder, decoder, Swin, segment everything, the nvJPEG
decode), and several engines share a GPU, so on a host of 16 cores a dozen of them can
spin at once and starve the frontends, which parse the requests on the same cores. On an
H200 with 16 cores (the load client on the same host), classify @2,000/s held with two
engines (p99 251 ms) and collapsed with six (1,637 ok/s, timeouts; the frontends' event
loops 236 ms late at the median) while the GPU was busy under 40% of the time
(docs/BENCHMARKS.md, issue 19, nineteenth session). Spinning cores are the suspect, not
yet the measured cause.

`SERVE_CUDA_WAIT`: `spin` (CUDA's default), `yield` (spin, but give the core to any
other ready thread at each poll) or `blocking` (sleep on an interrupt: no core used while
waiting, a wake-up of tens of microseconds more). The flag belongs to the device's
primary context, which PyTorch uses, and must be set before that context is made: the
driver API is called through ctypes (PyTorch has no call for it), right after the engine
process starts and before anything touches CUDA.
"""

from __future__ import annotations

import ctypes
from typing import Literal

__all__ = ["FLAGS", "CudaWait", "set_cuda_wait"]

CudaWait = Literal["spin", "yield", "blocking"]
# CUctx_flags' scheduling bits (cuda.h): CU_CTX_SCHED_SPIN, _YIELD, _BLOCKING_SYNC
FLAGS: dict[str, int] = {"spin": 0x01, "yield": 0x02, "blocking": 0x04}


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
