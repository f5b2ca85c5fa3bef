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
from server.engine import build
from server.engine.build import (
    VariantUnsupportedError,
    resolve_kernels,
    swin_attention_form,
    use_kernels,
    use_precision,
    variant_refusal,
)
from server.engine.services import Engine
from server.settings import Settings
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
    refusal = start_refusal(small_settings(quantization="int8", enable_sam=False))
    message = str(refusal)
    assert message.startswith("SERVE_QUANTIZATION=int8 cannot run on this device (cpu)")
    assert "Swin, batch 1" in message and "CUBLAS_STATUS_NOT_SUPPORTED" in message
    assert "SERVE_QUANTIZATION=none" in message
    assert isinstance(refusal.__cause__, RuntimeError)


def start_refusal(settings: Settings) -> VariantUnsupportedError:
    """What an engine's start-up (load, then warm-up) with `settings` refuses with."""
    engine = Engine(settings)

    async def start() -> None:
        try:
            await engine.load()
            await engine.warmup()
        finally:
            await engine.close()

    with pytest.raises(VariantUnsupportedError) as caught:
        asyncio.run(start())
    return caught.value


def test_other_errors_and_unquantized_variants_keep_their_own_error() -> None:
    cpu = torch.device("cpu")
    refused = RuntimeError(CUBLAS)
    assert variant_refusal(small_settings(), cpu, "step", refused) is None  # nothing chosen
    assert variant_refusal(small_settings(quantization="int8"), cpu, "step",
                           RuntimeError("CUDA out of memory")) is None  # fmt: skip
    sparse = variant_refusal(small_settings(sparsity="2:4"), cpu, "loading SAM",
                             RuntimeError("cuSPARSELt not supported on this GPU"))  # fmt: skip
    assert sparse is not None and str(sparse).startswith("SERVE_SPARSITY=2:4 cannot run")
    # Swin's own quantisation is named where it was chosen, not its default
    swin = variant_refusal(small_settings(swin_quantization="int8"), cpu, "Swin", refused)
    assert swin is not None and str(swin).startswith("SERVE_SWIN_QUANTIZATION=int8 cannot run")


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


def test_the_swin_kernel_asked_for_where_it_cannot_run_is_refused_at_start() -> None:
    """`SERVE_SWIN_ATTENTION=kernel` on the CPU would fail at the first classify (a Triton
    launch on CPU tensors): start-up refuses it naming the setting, before any weights
    load, and `auto` resolves per device."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert swin_attention_form(small_settings(), cpu) == "matmul"
    assert swin_attention_form(small_settings(), cuda) == "kernel"  # Triton is installed here
    assert swin_attention_form(small_settings(swin_attention="sdpa"), cuda) == "sdpa"
    message = str(start_refusal(small_settings(swin_attention="kernel", enable_sam=False)))
    assert message.startswith("SERVE_SWIN_ATTENTION=kernel cannot run on this device (cpu)")
    assert "auto" in message and "matmul" in message


def test_the_gluon_kernels_asked_for_where_they_cannot_run_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`SERVE_KERNELS=gluon` names Hopper kernels: elsewhere start-up refuses it naming the
    setting, before any weights load; `auto` takes them only where they run."""
    with pytest.raises(VariantUnsupportedError) as caught:
        Engine(small_settings(kernels="gluon"))
    message = str(caught.value)
    assert message.startswith("SERVE_KERNELS=gluon cannot run on this device: cpu is not a CUDA")
    assert "auto" in message and "triton" in message
    cpu = torch.device("cpu")
    assert resolve_kernels(small_settings(), cpu) == "triton"
    assert resolve_kernels(small_settings(kernels="triton"), cpu) == "triton"
    # where nothing stands in their way (a Hopper whose Triton has Gluon), auto takes them
    monkeypatch.setattr(build, "gluon_unsupported", lambda device: None)
    assert resolve_kernels(small_settings(), cpu) == "gluon"
    assert resolve_kernels(small_settings(kernels="gluon"), cpu) == "gluon"
    assert resolve_kernels(small_settings(kernels="triton"), cpu) == "triton"


def test_the_kernels_setting_turns_all_three_switches_together() -> None:
    """The int8 GEMMs and both attentions read module switches at each launch; the engine
    sets them once for its process, both ways (an engine after another in one process)."""
    from models import gemm_persistent
    from models.sam import fused_attention

    def switches() -> tuple[bool, bool, bool]:
        return (gemm_persistent.GLUON, fused_attention.GLUON_GLOBAL,
                fused_attention.GLUON_WINDOW)  # fmt: skip

    before = switches()
    try:
        use_kernels("gluon")
        assert switches() == (True, True, True)
        use_kernels("triton")
        assert switches() == (False, False, False)
        engine = Engine(small_settings())
        asyncio.run(engine.close())
        assert engine.kernels == "triton" and switches() == (False, False, False)
    finally:
        gemm_persistent.GLUON, fused_attention.GLUON_GLOBAL, fused_attention.GLUON_WINDOW = before


def test_the_served_swin_runs_the_form_the_setting_names() -> None:
    """Every window attention of the loaded classifier takes the setting's form (the
    written-out and SDPA forms both run on the CPU, so both are served here)."""
    from models.swin.model import WindowAttention

    for form in ("matmul", "sdpa"):
        engine = Engine(small_settings(swin_attention=form, enable_sam=False))

        async def load(engine: Engine = engine) -> list[str]:
            try:
                await engine.load()
                assert engine.swin is not None
                model = engine.swin.stage.model
                return [m.form for m in model.modules() if isinstance(m, WindowAttention)]
            finally:
                await engine.close()

        forms = asyncio.run(load())
        assert forms and set(forms) == {form}, (form, forms)
