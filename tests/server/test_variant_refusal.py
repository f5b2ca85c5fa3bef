"""A quantized or sparse variant the device's libraries refuse stops start-up with the
setting to change, not a library error at the first request (issue 20).

On an H100 cuBLASLt refused Swin's int8 products (`CUBLAS_STATUS_NOT_SUPPORTED`); no CPU
library refuses them, so the test makes the int8 layer raise that error during warm-up, as
it did there, and checks what start-up says.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from models.optimize import OptimizeOptions
from models.quantize import Int8DynamicLinear
from server.engine.build import VariantUnsupportedError, use_precision, variant_refusal
from server.engine.services import Engine
from tests.server.conftest import small_settings

CUBLAS = (
    "CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul with transpose_mat1 1 "
    "transpose_mat2 1 m 288 n 802816 k 96"
)


def test_a_refused_int8_product_at_warm_up_names_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(self: Int8DynamicLinear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(CUBLAS)

    monkeypatch.setattr(Int8DynamicLinear, "forward", refused)
    engine = Engine(small_settings(quantization="int8", enable_sam=False))

    async def start() -> None:
        try:
            await engine.load()
            await engine.warmup()
        finally:
            await engine.close()

    with pytest.raises(VariantUnsupportedError) as caught:
        asyncio.run(start())
    message = str(caught.value)
    assert message.startswith("SERVE_QUANTIZATION=int8 cannot run on this device (cpu)")
    assert "Swin, batch 1" in message and "CUBLAS_STATUS_NOT_SUPPORTED" in message
    assert "SERVE_QUANTIZATION=none" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_other_errors_and_unquantized_variants_keep_their_own_error() -> None:
    cpu = torch.device("cpu")
    refused = RuntimeError(CUBLAS)
    assert variant_refusal(small_settings(), cpu, "step", refused) is None  # nothing chosen
    assert variant_refusal(small_settings(quantization="int8"), cpu, "step",
                           RuntimeError("CUDA out of memory")) is None  # fmt: skip
    sparse = variant_refusal(small_settings(sparsity="2:4"), cpu, "loading SAM",
                             RuntimeError("cuSPARSELt not supported on this GPU"))  # fmt: skip
    assert sparse is not None and str(sparse).startswith("SERVE_SPARSITY=2:4 cannot run")


def test_tf32_is_refused_where_no_tensor_core_can_run_it() -> None:
    """On the CPU (or a GPU before Ampere) `tf32` would quietly be plain fp32."""
    with pytest.raises(VariantUnsupportedError) as caught:
        Engine(small_settings(precision="tf32"))
    message = str(caught.value)
    assert message.startswith("SERVE_PRECISION=tf32 cannot run on this device (cpu)")
    assert "compute capability 8.0" in message and "SERVE_PRECISION=fp32" in message


def test_tf32_sets_the_process_matmul_precision_and_others_leave_it() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        use_precision(OptimizeOptions(precision="fp32"))
        assert torch.get_float32_matmul_precision() == before == "highest"
        use_precision(OptimizeOptions(precision="tf32"))
        assert torch.get_float32_matmul_precision() == "high"
        assert OptimizeOptions(precision="tf32").dtype == torch.float32
        assert OptimizeOptions(precision="tf32").variant == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
