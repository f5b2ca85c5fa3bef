"""`SERVE_CUDA_WAIT`: the scheduling flag an engine gives its GPU's primary context.

CI has no CUDA driver, so the driver library is a stand-in object here that records the
calls `set_cuda_wait` makes through ctypes: the order (cuInit, then the device, then the
flag), the flag's value for each mode (cuda.h's CU_CTX_SCHED_*), and the reason given when
a call fails. What the flag does to a waiting thread is measured on the GPU
(bench/cuda_wait.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from pydantic import ValidationError

from server.engine import cuda_wait
from server.engine.cuda_wait import set_cuda_wait
from server.settings import Settings


class FakeDriver:
    """libcuda.so.1's three entry points, answering `codes` (0: success)."""

    def __init__(self, codes: dict[str, int] | None = None) -> None:
        self.codes = codes or {}
        self.calls: list[tuple[str, Any]] = []

    def cuInit(self, flags: int) -> int:  # noqa: N802 (the driver's names)
        self.calls.append(("cuInit", flags))
        return self.codes.get("cuInit", 0)

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:  # noqa: N802
        ctypes.cast(device, ctypes.POINTER(ctypes.c_int))[0] = 40 + ordinal
        self.calls.append(("cuDeviceGet", ordinal))
        return self.codes.get("cuDeviceGet", 0)

    def cuDevicePrimaryCtxSetFlags(self, device: ctypes.c_int, flags: int) -> int:  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxSetFlags", (device.value, flags)))
        return self.codes.get("cuDevicePrimaryCtxSetFlags", 0)


def with_driver(monkeypatch: pytest.MonkeyPatch, driver: FakeDriver) -> None:
    def load(name: str) -> FakeDriver:
        assert name == "libcuda.so.1"
        return driver

    monkeypatch.setattr(cuda_wait.ctypes, "CDLL", load)


@pytest.mark.parametrize(("mode", "flag"), [("spin", 1), ("yield", 2), ("blocking", 4)])
def test_each_mode_sets_its_flag_on_the_device_s_primary_context(monkeypatch, mode, flag):
    driver = FakeDriver()
    with_driver(monkeypatch, driver)
    assert set_cuda_wait(mode) is None
    assert driver.calls == [
        ("cuInit", 0),
        ("cuDeviceGet", 0),
        ("cuDevicePrimaryCtxSetFlags", (40, flag)),  # the device the driver named
    ]


def test_a_failing_driver_call_is_named_and_stops_there(monkeypatch):
    driver = FakeDriver({"cuDeviceGet": 100})  # CUDA_ERROR_NO_DEVICE
    with_driver(monkeypatch, driver)
    assert set_cuda_wait("blocking") == "cuDeviceGet returned CUDA error 100"
    assert [name for name, _ in driver.calls] == ["cuInit", "cuDeviceGet"]


def test_without_a_driver_the_reason_is_given_not_raised(monkeypatch):
    """The engine logs the reason and keeps CUDA's default (a CPU host, or a container
    without the driver's library)."""

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_wait.ctypes, "CDLL", missing)
    assert set_cuda_wait("yield") == (
        "no CUDA driver (libcuda.so.1: cannot open shared object file)"
    )


def test_the_setting_takes_the_four_modes_and_refuses_others():
    assert Settings().cuda_wait == "auto"
    for mode in ("auto", "spin", "yield", "blocking"):
        assert Settings(cuda_wait=mode).cuda_wait == mode
    with pytest.raises(ValidationError, match="cuda_wait"):
        Settings(cuda_wait="sleep")


def test_auto_is_blocking_and_the_named_modes_are_themselves():
    # blocking freed the cores six engines' spinning waits took (server/engine/cuda_wait.py)
    assert cuda_wait.cuda_wait_mode("auto") == "blocking"
    for mode in ("spin", "yield", "blocking"):
        assert cuda_wait.cuda_wait_mode(mode) == mode
    with pytest.raises(ValueError, match="SERVE_CUDA_WAIT='sleep'"):
        cuda_wait.cuda_wait_mode("sleep")
