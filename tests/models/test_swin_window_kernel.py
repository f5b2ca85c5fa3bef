"""Swin's window attention kernel (`models/swin/window_kernel.py`) against the written-out
attention it replaces: the op alone on plain and shifted grids, whole models, the
compiled graph and the exported program (AOT packages).

CI has no GPU, so the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py), where `runs_triton` holds for CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

from models.swin import SWIN_CONFIGS, load_swin
from models.swin.model import SwinBlock, WindowAttention
from tests.models.interpreter import run_interpreted

OP = r"""
import json, sys
import torch
from models.swin.model import shift_attention_mask, window_partition, window_reverse
from models.swin.model import relative_position_index
from models.swin.window_kernel import window_attention

def written_out(qkv, table, heads, window, shift):
    # the model's "matmul" form, step by step, on the grid's qkv projection
    B, H, W, c3 = qkv.shape
    C, N = c3 // 3, window * window
    x = torch.roll(qkv, (-shift, -shift), (1, 2)) if shift else qkv
    x = window_partition(x, window)  # [B, nW, N, 3C]
    nW = x.shape[1]
    q, k, v = x.view(B, nW, N, 3, heads, C // heads).permute(3, 0, 1, 4, 2, 5).unbind(0)
    bias = table[relative_position_index(window).view(-1)].view(N, N, heads).permute(2, 0, 1)
    scores = (q * (C // heads) ** -0.5) @ k.transpose(-2, -1) + bias
    if shift:
        scores = scores + shift_attention_mask(H, window, shift)[:, None].to(scores.dtype)
    out = (scores.softmax(-1) @ v).transpose(2, 3).reshape(B, nW, N, C)
    out = window_reverse(out, window, H, W)
    return torch.roll(out, (shift, shift), (1, 2)) if shift else out

results = []
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    B, res, window, shift = case["B"], case["res"], case["window"], case["shift"]
    heads, d = case["heads"], case["d"]
    C = heads * d
    table = (torch.randn((2 * window - 1) ** 2, heads) * 2).to(dtype)
    qkv = (torch.randn(B, res, res, 3 * C) * 2).to(dtype)
    if case.get("strided"):  # a view whose tokens are not packed (the kernel reads strides)
        qkv = torch.randn(B, res, res, 4 * C).to(dtype)[..., :3 * C]
    got = window_attention(qkv, table, heads, window, shift)
    want = written_out(qkv.double(), table.double(), heads, window, shift)
    diff = (got.double() - want).abs()
    results.append({
        "shape": list(got.shape), "dtype": str(got.dtype),
        "max_diff": float(diff.max()), "scale": float(want.abs().max()),
    })
print(json.dumps(results))
"""


def test_the_kernel_equals_the_written_out_attention() -> None:
    """Plain and shifted windows on several grids (a window of 49 tokens runs as 64, one
    of 16 exactly), fp32 and bf16, against the model's written-out form in fp64."""
    grids = [  # B, res, window, shift, heads, head dim
        (2, 8, 4, 0, 2, 16), (2, 8, 4, 2, 2, 16), (1, 14, 7, 3, 3, 32), (2, 7, 7, 0, 2, 32),
    ]  # fmt: skip
    keys = ("B", "res", "window", "shift", "heads", "d")
    cases = [
        {"seed": i, "dtype": "float32", **dict(zip(keys, grid, strict=True))}
        for i, grid in enumerate(grids)
    ]
    cases.append(
        {"seed": 4, "dtype": "bfloat16", **dict(zip(keys, (1, 14, 7, 3, 2, 32), strict=True))}
    )
    # a view whose tokens are not packed, and a head dim the kernel pads (24 as 32)
    strided = dict(zip(keys, (1, 8, 4, 2, 1, 24), strict=True))
    cases.append({"seed": 5, "dtype": "float32", "strided": True, **strided})
    results = run_interpreted(OP, cases)
    for case, result in zip(cases, results, strict=True):
        C = case["heads"] * case["d"]
        assert result["shape"] == [case["B"], case["res"], case["res"], C], (case, result)
        assert result["dtype"] == f"torch.{case['dtype']}", (case, result)
        tolerance = 1e-5 if case["dtype"] == "float32" else 2e-2
        assert result["max_diff"] <= tolerance * result["scale"], (case, result)


MODEL = r"""
import json, sys
import torch
from models.swin.model import WindowAttention
from models.swin import SWIN_CONFIGS, load_swin
from models.swin.config import SwinConfig

NARROW = SwinConfig("swin_narrow_224", 16, (2, 2, 2, 2), (1, 2, 2, 4))
configs = {"swin_test": SWIN_CONFIGS["swin_test"], "swin_narrow_224": NARROW}

def set_form(model, form):
    for module in model.modules():
        if isinstance(module, WindowAttention):
            module.form = form

results = []
for case in json.loads(sys.argv[1]):
    config = configs[case["config"]]
    model = load_swin(config, None, seed=case["seed"])
    with torch.no_grad():  # a bias table that matters (a fresh one is zeros)
        for module in model.modules():
            if isinstance(module, WindowAttention):
                module.relative_position_bias_table.normal_(0, 1)
    dtype = getattr(torch, case["dtype"])
    model = model.to(dtype)
    torch.manual_seed(case["seed"])
    x = torch.randn(case["batch"], 3, config.img_size, config.img_size, dtype=dtype)
    with torch.inference_mode():
        set_form(model, "matmul")
        want = model(x).float()
        set_form(model, "kernel")
        got = model(x).float()
        calls = set()

        def record(gm, example_inputs):
            calls.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        compiled = torch.compile(model, backend=record, fullgraph=True)(x).float()
    results.append({
        "error": float((got - want).norm() / want.norm()),
        "agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "compiled_error": float((compiled - got).norm() / got.norm()),
        "kernel_calls": sorted(c for c in calls if "swin_serve" in c),
        "written_out_calls": sorted(c for c in calls if "roll" in c or "softmax" in c),
    })
print(json.dumps(results))
"""


def test_a_model_on_the_kernel_gives_the_written_out_logits() -> None:
    """Whole models with the kernel in every block (shifted windows in every stage that
    has them, the last 7x7 stage unshifted) give the written-out form's logits, and
    torch.compile captures the kernel as one opaque op with no roll or softmax left."""
    cases = [
        {"config": "swin_test", "seed": 1, "dtype": "float32", "batch": 2},
        {"config": "swin_test", "seed": 3, "dtype": "bfloat16", "batch": 2},
        # 49-token windows (run as 64), shifted in three stages, the last 7x7 stage not
        {"config": "swin_narrow_224", "seed": 2, "dtype": "float32", "batch": 1},
    ]
    results = run_interpreted(MODEL, cases)
    for case, result in zip(cases, results, strict=True):
        fp32 = case["dtype"] == "float32"
        assert result["error"] < (1e-5 if fp32 else 3e-2), (case, result)
        if fp32:
            assert result["agree"] == 1.0, (case, result)
        assert result["compiled_error"] < 1e-6, (case, result)
        assert result["kernel_calls"] == ["swin_serve.window_attention.default"], result
        assert result["written_out_calls"] == [], result


EXPORT = r"""
import json, sys
import torch
from models.aot import export_batched
from models.swin.model import WindowAttention
from models.swin import SWIN_CONFIGS, load_swin

[path, step] = json.loads(sys.argv[1])[0]
model = load_swin(SWIN_CONFIGS["swin_test"], None, seed=4)
torch.manual_seed(4)  # the same tables in both processes
with torch.no_grad():
    for module in model.modules():
        if isinstance(module, WindowAttention):
            module.relative_position_bias_table.normal_(0, 1)
            module.form = "kernel"
size = model.config.img_size
if step == "export":
    exported = export_batched(model, torch.zeros(1, 3, size, size))
    torch.export.save(exported, path)
    calls = sorted({str(n.target) for n in exported.graph.nodes if n.op == "call_function"})
    print(json.dumps([calls]))
else:
    from models.swin.window_kernel import _exported_op

    _exported_op()  # the op the saved program calls
    program = torch.export.load(path).module()
    torch.manual_seed(5)
    x = torch.randn(3, 3, size, size)
    with torch.inference_mode():
        want = model(x)
        errors = {}
        for batch in (1, 3):  # the exported batch is dynamic
            got = program(x[:batch])
            errors[str(batch)] = float((got - want[:batch]).norm() / want[:batch].norm())
    print(json.dumps([errors]))
"""


def test_the_exported_classifier_carries_the_kernel(tmp_path) -> None:
    """An AOT package is built from `models.aot.export_batched`'s program: with the kernel
    its blocks trace to the kernel's traceable twin (which a package compiles in), with a
    dynamic batch, and the program computes what the served op computes. The export runs
    with Triton as it is (the interpreter's kernels cannot be traced), the program in the
    interpreter."""
    path = str(tmp_path / "swin.pt2")
    [calls] = run_interpreted(EXPORT, [[path, "export"]], interpret=False)
    assert "swin_serve.window_attention_exported.default" in calls, calls
    assert not [c for c in calls if "softmax" in c or "roll" in c], calls
    [errors] = run_interpreted(EXPORT, [[path, "run"]])
    assert errors["1"] < 1e-6 and errors["3"] < 1e-6, errors


def test_auto_takes_the_kernel_only_where_it_runs_compiled() -> None:
    """ "auto" (the default) is the kernel on CUDA and the written-out form elsewhere: a
    CPU host, CI's, never runs the kernel outside the interpreter's tests."""
    model = load_swin(SWIN_CONFIGS["swin_test"], None, seed=0)
    layers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    assert layers and all(layer.form == "auto" for layer in layers)
    assert layers[0].chosen_form(torch.device("cpu")) == "matmul"
    blocks = [m for m in model.modules() if isinstance(m, SwinBlock)]
    assert any(block.shift for block in blocks)


@pytest.mark.parametrize("bad", [(8, 3), (6, 4)])
def test_a_grid_the_windows_do_not_tile_is_refused(bad: tuple[int, int]) -> None:
    """A grid the window does not divide (the config never builds one) fails with its
    shapes named, not with a wrong answer; the check runs before any kernel."""
    from models.swin.window_kernel import _launch

    res, window = bad
    qkv = torch.zeros(1, res, res, 3 * 8)
    with pytest.raises(ValueError, match="windows"):
        _launch(qkv, torch.zeros((2 * window - 1) ** 2, 2), 2, window, 0)


def test_a_batch_past_the_grid_s_second_axis_is_refused() -> None:
    """Images x heads is the launch grid's second axis, which CUDA stops at 65,535: a
    larger batch (never the service's: 256 at most) fails with the split to make, not
    with a launch error, and before any kernel."""
    from models.swin.window_kernel import _launch

    qkv = torch.zeros(1, 7, 7, 3 * 8).expand(65_536, 7, 7, 3 * 8)  # no memory: a view
    with pytest.raises(ValueError, match="split the batch"):
        _launch(qkv, torch.zeros(13 * 13, 1), 1, 7, 0)
