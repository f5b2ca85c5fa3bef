"""The Triton rel-pos flash-attention kernel against the plain dense-bias attention.

The kernel computes the rel-pos terms itself from the tables; the reference builds them
with `rel_pos_terms` and the dense bias.

Model code reaches the kernel only through its custom op, both ways checked here (the
encoder's `fused_qkv_attention`, and `rel_pos_attention(..., "triton")`); the bare `launch`
is checked too, as bench/sam_encoder.py sweeps its launch shapes with it.

CI has no GPU, so the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, read when
Triton is imported, hence a subprocess): the same kernel source, executed with numpy. It
checks the arithmetic and the indexing (key rows, masked query tails, padded head dims,
arbitrary strides); speed is measured on the GPU by bench/sam_encoder.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from models.sam.fused_attention import MAX_GRID_W, fused_supported, triton_available
from tests.models.interpreter import run_interpreted, run_interpreted_together

SCRIPT = r"""
import json, sys
import torch
from models.sam.attention import fused_qkv_attention, rel_pos_attention
from models.sam import fused_attention
from models.sam.fused_attention import KernelConfig, dense_rows, launch
from models.mlp_static import quantize_static

results = []
for seed, (B, heads, gh, gw, C, block_m) in enumerate(json.loads(sys.argv[1])):
    KernelConfig.block_m = block_m
    g = torch.Generator().manual_seed(seed)
    # q, k, v as views of one qkv tensor, as the encoder makes them (non-contiguous)
    qkv = torch.randn(B, gh * gw, 3, heads, C, generator=g).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    rph = torch.randn(2 * gh - 1, C, generator=g)
    rpw = torch.randn(2 * gw - 1, C, generator=g)
    ref = rel_pos_attention(q, k, v, rph, rpw, (gh, gw), "sdpa")
    out = launch(q, k, v, rph, rpw)
    err = float((out - ref).norm() / ref.norm())
    # the op the encoder calls: q, k, v read out of the qkv projection, output token-major
    fused = fused_qkv_attention(qkv.permute(1, 3, 0, 2, 4).contiguous(), rph, rpw, (gh, gw))
    err = max(err, float((fused - ref.transpose(1, 2).reshape(fused.shape)).norm() / ref.norm()))
    # int8 for a projection that takes its input by fixed scales: what it would quantise
    inv = torch.rand(heads * C, generator=g) * 8 + 0.5
    int8 = fused_qkv_attention(qkv.permute(1, 3, 0, 2, 4).contiguous(), rph, rpw, (gh, gw), inv)
    int8_exact = int8.dtype == torch.int8 and torch.equal(int8, quantize_static(fused, inv))
    # rel_pos_attention's triton form: the same op, on q, k, v stacked into its layout
    via_op = rel_pos_attention(q, k, v, rph, rpw, (gh, gw), "triton")
    assert via_op.shape == ref.shape
    err = max(err, float((via_op - ref).norm() / ref.norm()))
    # the key rows loaded without masks, where the shape allows it
    fused_attention.DENSE_ROWS = True
    err = max(err, float((launch(q, k, v, rph, rpw) - ref).norm() / ref.norm()))
    fused_attention.DENSE_ROWS = False
    dense = dense_rows((gh, gw), (gh, gw), C, max(16, 1 << (gw - 1).bit_length()), block_m)
    results.append({"shape": [B, heads, gh, gw, C, block_m], "rel_err": err, "dense": dense,
                    "finite": bool(torch.isfinite(out).all()), "int8_exact": int8_exact})
print(json.dumps(results))
"""

CASES = [
    # B, heads, grid h, grid w, head dim, BLOCK_M (a key block is one row of the grid)
    (2, 3, 16, 16, 32, 64),  # 4 query blocks, 16 key rows
    (1, 2, 12, 16, 16, 128),  # 192 tokens: the second query block is half masked
    (1, 2, 8, 32, 24, 64),  # head dim 24 runs padded to 32 (ViT-H's 80 -> 128 the same way)
    (3, 2, 14, 14, 16, 64),  # SAM's 14x14 windows: rows of 14 keys in slots of 16
    (1, 1, 5, 20, 16, 64),  # a row wider than 16 and narrower than 32
]


@pytest.fixture(scope="module")
def interpreted() -> list[list[Any]]:
    """WINDOW_SCRIPT's and SCRIPT's results, run in one interpreted process (one start of
    Python, torch and Triton instead of two). The windows run first, on the default
    `KernelConfig`, as in a process of their own; SCRIPT then sets the blocks it sweeps."""
    return run_interpreted_together([(WINDOW_SCRIPT, WINDOW_CASES), (SCRIPT, CASES)])


def test_kernel_matches_dense_bias_attention(interpreted: list[list[Any]]) -> None:
    results = interpreted[1]
    for r in results:
        assert r["finite"], r
        assert r["rel_err"] < 1e-5, r  # fp32 throughout: only summation order differs
        assert r["int8_exact"], r
    # the first case's rows fill their slots (a global grid), the others' do not
    assert [r["dense"] for r in results] == [True, False, False, False, False]


def test_supported_on_cuda_for_rows_that_fit_a_block() -> None:
    cuda = torch.device("cuda")
    assert not fused_supported((64, 64), torch.device("cpu"))
    assert not fused_supported((4, MAX_GRID_W + 1), cuda)
    assert fused_supported((64, 64), cuda) == fused_supported((14, 14), cuda) == triton_available()


WINDOW_SCRIPT = r"""
import json, sys
import torch
from models.sam.image_encoder import Attention, window_partition, window_unpartition
from models.sam.fused_attention import window_flash
from models.mlp_static import quantize_static

results = []
for seed, (B, H, W, window, dim, heads, bias) in enumerate(json.loads(sys.argv[1])):
    torch.manual_seed(seed)
    attn = Attention(dim, heads, (window, window)).eval()
    if not bias:
        attn.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
    with torch.no_grad():
        for p in (attn.rel_pos_h, attn.rel_pos_w):
            p.normal_(0, 0.5)
        if bias:
            attn.qkv.bias.normal_(0, 1.0)  # padded tokens' keys and values: the bias
    x = torch.randn(B, H, W, dim)
    with torch.inference_mode():
        # Meta's way: zero-padded windows projected, attended, projected, cropped
        windows, padded = window_partition(x, window)
        ref = window_unpartition(attn(windows), window, padded, (H, W))
        attn.impl = "triton"
        got = attn.windowed(x)  # the grid read in place, in the interpreter
        with_residual = attn.windowed(x, x)  # the block's residual through the projection
        # int8 for a projection that takes its input by fixed scales: what it would quantise
        qkv = attn.qkv(x).reshape(B, H * W, 3, heads, -1)
        floats = window_flash(qkv, attn.rel_pos_h, attn.rel_pos_w, attn.qkv.bias, H, W)
        inv = torch.rand(dim) * 8 + 0.5
        int8 = window_flash(qkv, attn.rel_pos_h, attn.rel_pos_w, attn.qkv.bias, H, W, inv)
        int8_exact = int8.dtype == torch.int8 and torch.equal(int8, quantize_static(floats, inv))
    err = float((got - ref).norm() / ref.norm())
    err = max(err, float((with_residual - (ref + x)).norm() / (ref + x).norm()))
    results.append({"case": [B, H, W, window, dim, heads, bias], "rel_err": err,
                    "finite": bool(torch.isfinite(got).all()), "int8_exact": int8_exact})
print(json.dumps(results))
"""

WINDOW_CASES = [
    # B, grid H, grid W, window, width, heads, qkv bias
    (2, 20, 23, 7, 32, 2, True),  # 3x4 windows, the last row and column padded
    (1, 14, 14, 7, 32, 2, True),  # windows that tile the grid exactly
    (1, 9, 5, 7, 48, 3, False),  # one window wider than the grid, no bias: zero padding
]


def test_windows_read_in_place_match_meta_partitioned_windows(
    interpreted: list[list[Any]],
) -> None:
    """`Attention.windowed` (what the encoder's windowed blocks run on CUDA) against
    `window_partition` -> the same module on the windows -> `window_unpartition`: the same
    function, the padded tokens' keys and values included (qkv's bias, or zeros)."""
    results = interpreted[0]
    for r in results:
        assert r["finite"], r
        assert r["rel_err"] < 1e-5, r
        assert r["int8_exact"], r  # int8 for a projection by fixed scales


def test_windows_are_read_in_place_on_the_kernel(tiny_sam) -> None:
    """`prepare_sam_encoder` decides per block: the Triton kernel reads the windows in place,
    float or int8 qkv layers alike; the CPU (no kernel) partitions."""
    import copy

    from models.optimize import OptimizeOptions, prepare_sam_encoder

    cuda = torch.device("cuda")  # the options only: nothing runs here
    triton_opts = OptimizeOptions(attention="triton", window_attention="triton")

    def in_place(options: OptimizeOptions, device: torch.device) -> list[bool]:
        encoder = copy.deepcopy(tiny_sam.image_encoder)
        prepare_sam_encoder(encoder, options, device)
        return [b.windows_in_place for b in encoder.blocks if b.window > 0]

    windowed = len([b for b in tiny_sam.image_encoder.blocks if b.window > 0])
    assert windowed > 0
    assert in_place(triton_opts, cuda) == [triton_available()] * windowed
    int8 = OptimizeOptions(attention="triton", window_attention="triton", quantization="int8")
    assert in_place(int8, cuda) == [triton_available()] * windowed
    assert in_place(triton_opts, torch.device("cpu")) == [False] * windowed


# SAM's vit_tiny encoder with the kernel in both kinds of block: block 0 windowed (6x6
# windows over the 16x16 grid, read in place), block 1 global
ENCODER = r"""
import torch
from models.sam import SAM_CONFIGS, load_sam

def encoder(impl):
    enc = load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0).image_encoder.eval()
    for block in enc.blocks:
        block.attn.impl = impl
        block.windows_in_place = impl == "triton" and block.window > 0
    return enc
"""

EXPORT_SCRIPT = (
    ENCODER
    + r"""
import json, sys
from models.aot import export_batched

path = json.loads(sys.argv[1])[0]
exported = export_batched(encoder("triton"), torch.zeros(1, 3, 256, 256))
torch.export.save(exported, path)
calls = sorted({str(n.target) for n in exported.graph.nodes if n.op == "call_function"})
print(json.dumps([calls]))
"""
)

RUN_EXPORTED_SCRIPT = (
    ENCODER
    + r"""
import json, sys
from models.sam.fused_attention import exported_ops

exported_ops()  # the ops the saved program calls

path = json.loads(sys.argv[1])[0]
module = torch.export.load(path).module()
torch.manual_seed(1)
x = torch.randn(3, 3, 256, 256)
errors = {}
with torch.inference_mode():
    eager = encoder("triton")(x)  # the opaque ops, as torch.compile serves them
    reference = encoder("sdpa")(x)  # dense bias, partitioned windows: Meta's way
    for batch in (1, 3):  # the exported batch is dynamic
        got = module(x[:batch])
        errors[f"eager_{batch}"] = float((got - eager[:batch]).norm() / eager[:batch].norm())
        errors[f"sdpa_{batch}"] = float((got - reference[:batch]).norm() / reference.norm())

# torch.compile's graph of the same encoder: the opaque ops it was measured with, never
# the export twins (torch 2.11's dynamo took `is_exporting()` as True under compile)
compiled_calls = set()

def record(gm, example_inputs):
    compiled_calls.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return gm.forward

with torch.inference_mode():
    got = torch.compile(encoder("triton"), backend=record, fullgraph=True)(x)
errors["compiled"] = float((got - eager).norm() / eager.norm())
errors["compiled_calls"] = sorted(c for c in compiled_calls if "sam_serve" in c)
print(json.dumps([errors]))
"""
)


def test_the_exported_encoder_carries_the_kernel_and_gives_its_outputs(tmp_path) -> None:
    """An AOT package is built from `models.aot.export_batched`'s program: SAM's encoder
    with the kernel must trace to the kernel's traceable ops (which a package compiles in)
    and to no SDPA, with a dynamic batch, and that program must compute what the served
    ops compute, while torch.compile's graph of the encoder keeps the opaque ops. The
    export runs with Triton as it is (the interpreter's kernels cannot be
    traced); the program then runs in the interpreter. The package's build is the GPU's
    (bench/gpu_aot_attention.sh)."""
    path = str(tmp_path / "encoder.pt2")
    [calls] = run_interpreted(EXPORT_SCRIPT, [path], interpret=False)
    assert "sam_serve.rel_pos_flash_exported.default" in calls, calls
    assert "sam_serve.rel_pos_flash_windows_exported.default" in calls, calls
    assert not [c for c in calls if "scaled_dot_product" in c or "rel_pos_flash." in c], calls
    [errors] = run_interpreted(RUN_EXPORTED_SCRIPT, [path])
    for batch in (1, 3):
        assert errors[f"eager_{batch}"] < 1e-6, errors  # the same kernel, the same sums
        assert errors[f"sdpa_{batch}"] < 1e-4, errors  # fp32: summation order only
    assert errors["compiled"] < 1e-6, errors
    assert errors["compiled_calls"] == [
        "sam_serve.rel_pos_flash.default",
        "sam_serve.rel_pos_flash_windows.default",
    ], errors
