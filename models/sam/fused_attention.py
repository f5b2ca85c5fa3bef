"""Flash attention with SAM's decomposed relative positions, as one Triton kernel.

Why a kernel of our own: the global blocks of the encoder attend over 4096 tokens, and the
decomposed bias `rel_h[q, y'] + rel_w[q, x']` written out is as large as the attention
matrix (400 MB per image in bf16). SDPA with that dense bias falls back to the
memory-efficient kernel and reads the bias from memory; FlexAttention gathers two bias
terms per score and measured 3.5x slower still on an H100 (docs/BENCHMARKS.md).

The layout makes the bias nearly free: keys are stored row-major on the `h x w` grid, so a
block of `w` consecutive keys is exactly one grid row y'. For a block of queries, the
`rel_w` term is then the same `[BLOCK_M, w]` tile for every key block (loaded once, kept in
registers), and the `rel_h` term is one number per query per key row, which rides on the
row's running maximum rather than on every score. The kernel is
an online-softmax loop over the `h` key rows, each iteration one `q @ k^T` and one `p @ v`.
Both terms come from the tables inside the kernel: one product of the block's queries with
every row of each table before the loop (an einsum outside, with the copies of q it needed,
took 11% of the encoder's time on an H100: docs/BENCHMARKS.md).

Any grid: a key row of width w is loaded as a block of the next power of two (at least 16,
what `tl.dot` needs) with the extra keys masked out, so the 14x14 windows run as 14x16 and
the 64x64 global grid exactly. Any head dim, padded the same way (ViT-H's 80 runs as 128).
Forward only: this is an inference service.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import Tensor

from models.aot import exporting
from models.triton_device import triton_installed as triton_available

__all__ = [
    "MAX_GRID_W",
    "KernelConfig",
    "exported_ops",
    "fused_rel_pos_attention",
    "fused_supported",
    "fused_window_attention",
    "rel_pos_flash",
    "triton_available",
    "window_flash",
]


def fused_supported(grid: tuple[int, int], device: torch.device) -> bool:
    """Whether the kernel can run this grid here: CUDA, Triton installed, a row of keys
    that fits one block (the kernel keeps a `[BLOCK_M, w]` tile in registers)."""
    return triton_available() and device.type == "cuda" and 0 < grid[1] <= MAX_GRID_W


MAX_GRID_W = 128


class KernelConfig:
    """Launch shape by the width of a key row's slots (w keys take the next power of two,
    at least 16: 64 for the global grid, 16 for a 14x14 window); bench/sam_encoder.py
    --flex-kernel sweeps it (docs/BENCHMARKS.md, issue 20's thirteenth session)."""

    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Keys a block: always one grid row (a row's rel_h is then one number per query, added
    # to its row maximum). Batch 8, H200: a 14x14 window layer 0.30-0.32 ms, as fast as
    # four rows a block (0.32) and faster than a window's 196 keys in one block (0.48-0.80)
    # or the terms by the tensor cores (the queries' rel_h and rel_w times the keys'
    # one-hot rows and columns: 0.31-0.45); the global layer 1.28 with the cap below against
    # 1.41 for two rows. The other forms were tried and dropped (docs/BENCHMARKS.md, issue
    # 20's thirteenth session; the kernel at `dbb6f13` held them).
    # A register cap by (row slots, padded head dim): at 168 three programs of 4 warps
    # share an SM where the compiler's 183 registers let two (ncu; ViT-B's heads of 64);
    # the global layer 1.28-1.31 ms against 1.44-1.48 uncapped and 1.41 for two rows a
    # block. Windows run at 91 registers, five programs an SM, uncapped. Wider heads
    # (ViT-H's 80 run as 128) hold twice the accumulator and were not measured capped.
    maxnreg: ClassVar[dict[tuple[int, int], int]] = {(64, 64): 168}


# Whether `launch` loads the key rows without masks where every slot holds a key inside
# the image (`dense_rows`: the global blocks). Compiled for sm_90 with Triton 3.6.0 the
# global kernel's loop over key rows falls from 368 instructions to 341, its 12 selects and
# the predicates' arithmetic gone, no spills (`python -m bench.attention_sass`). On an H200
# the encoder ran within the spread between runs with it (+0.3% int8, +0.7% bf16 at batch 8;
# docs/BENCHMARKS.md, issue 20, nineteenth session), so off (bench/sam_encoder.py's `-dense`
# variants turn it on).
DENSE_ROWS = False

# Whether the global blocks go to the warp-specialised Gluon kernel
# (models/sam/gluon_attention.py: two consumer warp groups share each key and value tile a
# producer warp loads by TMA) where it runs the layer: on an H100 a global layer at batch 8
# took 1.217 ms against this kernel's 1.262, at the same fidelity (bench/gluon_attention.py;
# docs/BENCHMARKS.md, issue 20, twenty-second session). The engine sets it from
# SERVE_KERNELS (server.engine.build.use_kernels: on for Hopper by default; the encoder
# bench's `-gattn` variants turn it on); traced launches (AOT) keep this kernel.
GLUON_GLOBAL = False

# Whether the windowed blocks go to the warp-specialised Gluon window kernel
# (models/sam/gluon_window_attention.py: a window's 196 keys in the 256 slots of its box,
# two products of 128, the decomposed bias from the tensor cores) where it runs the layer:
# on an H100 a windowed layer at batch 8 took 0.173-0.177 ms against this kernel's
# 0.271-0.274, at the same fidelity (bench/gluon_window_attention.py; docs/BENCHMARKS.md,
# issue 20, twenty-fourth session). Set with GLUON_GLOBAL by the engine from SERVE_KERNELS
# (the encoder bench's `-gwin` variants turn it on); traced launches (AOT) keep this
# kernel.
GLUON_WINDOW = False


def dense_rows(
    grid: tuple[int, int], image: tuple[int, int], head_dim: int, block_w: int, block_m: int
) -> bool:
    """Every load of the kernel's loop in bounds: the windows tile the image exactly, a
    key row fills its BLOCK_W slots, the head its HEAD_DIM and the queries their blocks."""
    (grid_h, grid_w), (img_h, img_w) = grid, image
    return (
        img_h % grid_h == 0
        and img_w % grid_w == 0
        and block_w == grid_w
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0  # HEAD_DIM, the next power of two, is head_dim
        and (grid_h * grid_w) % block_m == 0
    )


@functools.cache
def _kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def rel_pos_flash_fwd(
        Q, K, V, RPH, RPW, S, O, BIAS_K, BIAS_V,
        stride_qb, stride_qh, stride_qn,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_rph, stride_rpw, stride_sbh, stride_sw, stride_sn,
        stride_ob, stride_oh, stride_on,
        heads, n_ctx, head_dim, grid_w, img_h, img_w, q_blocks,
        GRID_H: tl.constexpr, BLOCK_W: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        QK_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, DENSE: tl.constexpr = False,
    ):  # fmt: skip
        LOG2E: tl.constexpr = 1.4426950408889634
        # The attention grid (GRID_H x grid_w) is one window of an img_h x img_w grid of
        # tokens, windows laid out row-major over it (a global block: one window, the
        # whole grid). Tokens are read and written where they lie in the image's grid, so
        # there are no partition or unpartition copies; a window's tokens past the
        # image's edge stand for the zero padding Meta's encoder adds before qkv: their
        # keys and values are the qkv projection's bias, their queries are not computed.
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        win = pid_m // q_blocks
        b = pid_bh // heads
        h = pid_bh % heads
        windows_w = (img_w + grid_w - 1) // grid_w
        y0 = (win // windows_w) * GRID_H  # the window's first image row and column
        x0 = (win % windows_w) * grid_w
        offs_m = (pid_m % q_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        qy = offs_m // grid_w
        qx = offs_m % grid_w
        mask_m = (offs_m < n_ctx) & (y0 + qy < img_h) & (x0 + qx < img_w)
        mask_d = offs_d < head_dim
        token_m = (y0 + qy) * img_w + x0 + qx

        q_ptrs = Q + b * stride_qb + h * stride_qh + token_m[:, None] * stride_qn + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        # The bias's two factors, q . Rh[qy - y' + h - 1] and q . Rw[qx - x' + w - 1]: one
        # product of the block's queries with every row of each table (2h-1 and 2w-1
        # relative offsets), kept in this program's slice of S, then read back shifted
        # per query. Built outside by an einsum (batched 64x64 products, and copies of q)
        # they cost more than these two products do here.
        offs_ph = tl.arange(0, PH)
        offs_pw = tl.arange(0, PW)
        rph = tl.load(
            RPH + offs_ph[:, None] * stride_rph + offs_d[None, :],
            mask=(offs_ph < 2 * GRID_H - 1)[:, None] & mask_d[None, :],
            other=0.0,
        )
        rpw = tl.load(
            RPW + offs_pw[:, None] * stride_rpw + offs_d[None, :],
            mask=(offs_pw < 2 * grid_w - 1)[:, None] & mask_d[None, :],
            other=0.0,
        )
        uh = tl.dot(q, tl.trans(rph.to(q.dtype)))  # [BLOCK_M, PH]
        uw = tl.dot(q, tl.trans(rpw.to(q.dtype)))  # [BLOCK_M, PW]
        s_rows = S + pid_bh * stride_sbh + win * stride_sw + offs_m * stride_sn
        s_type = S.dtype.element_ty
        tl.store(s_rows[:, None] + offs_ph[None, :], uh.to(s_type), mask=mask_m[:, None])
        tl.store(s_rows[:, None] + PH + offs_pw[None, :], uw.to(s_type), mask=mask_m[:, None])
        tl.debug_barrier()  # what other threads of this program stored is read back below
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        o_ptrs = O + b * stride_ob + h * stride_oh + token_m[:, None] * stride_on + offs_d[None, :]
        # A key block is one grid row of BLOCK_W slots: the row's w keys, the rest masked.
        col = tl.arange(0, BLOCK_W)
        mask_col = col < grid_w
        # rel_w[q, x'] for x' = 0..w-1: the same for every key row, so loaded once (-inf
        # where a slot holds no key, so it weighs nothing).
        rw = tl.load(
            s_rows[:, None] + PH + (qx[:, None] + grid_w - 1 - col[None, :]),
            mask=mask_m[:, None] & mask_col[None, :],
            other=0.0,
        )
        rw = tl.where(mask_col[None, :], rw.to(tl.float32) * LOG2E, float("-inf"))
        rh_ptrs = s_rows + qy + GRID_H - 1  # rel_h[q, y'] sits at this minus y'

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # One key row a block: rel_h[q, y'] is one number per query for the whole block, so
        # it rides on the row maximum and the exponent's offset (a [BLOCK_M] vector) instead
        # of being spread over the [BLOCK_M, w] scores, which took a pass through shared
        # memory every block (ncu, H200: the stall at the top of the global kernel's
        # profile). The next row's rel_h is loaded one ahead.
        col_in = mask_col & (x0 + col < img_w)  # the slots inside the image, every row
        if HAS_BIAS:
            # A window past the image's edge holds Meta's padding, whose key and value are
            # qkv's bias: they load as zeros, and the bias comes in by the block's constants
            # instead of a [keys, head_dim] select per row (two of those made the windows
            # read in place 10% slower than partitioned ones, H200: docs/BENCHMARKS.md,
            # issue 20, seventeenth session). The scores' q . b_k is one number per query,
            # folded into rel_w's tile: for the padded columns of every row, and all of a
            # padded row's (`rw_pad`); the values' b_v is added once at the end, weighted
            # by the padded keys' share of p.
            bias_k = tl.load(BIAS_K + h * head_dim + offs_d, mask=mask_d, other=0.0)
            bias_v = tl.load(BIAS_V + h * head_dim + offs_d, mask=mask_d, other=0.0)
            bk = bias_k.to(q.dtype).to(tl.float32)  # as the padded keys' values were
            qbk = tl.sum(q.to(tl.float32) * bk[None, :], 1) * QK_SCALE
            rw_pad = rw + qbk[:, None]
            pad_col = mask_col & ~col_in
            rw = tl.where(pad_col[None, :], rw_pad, rw)
            pad_col_f = pad_col.to(tl.float32)
            has_pad_col = x0 + grid_w > img_w
            pad_p = tl.zeros([BLOCK_M], dtype=tl.float32)  # the padded keys' share
        rh_next = tl.load(rh_ptrs, mask=mask_m, other=0.0)
        for row in range(0, GRID_H):
            row_in = y0 + row < img_h
            offs_n = (y0 + row) * img_w + x0 + col
            if DENSE:  # every slot a key inside the image: no masks
                kv_mask, kv_other = None, None
            else:
                # the row's test as a vector of one value: the interpreter turns a vector
                # and a scalar mask into int32 (the compiler folds it to the scalar)
                kv_mask = (col_in & (y0 + row + 0 * col < img_h))[:, None] & mask_d[None, :]
                kv_other = 0.0
            k = tl.load(
                k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask,
                other=kv_other,
            )  # fmt: skip
            # log2 units: scale * log2(e) folded in; rel_w added here, the same every row
            s = tl.dot(q, tl.trans(k)) * QK_SCALE
            if HAS_BIAS:  # noqa: SIM108 (a constexpr test; a nested ternary reads worse)
                s = s + rw if row_in else s + rw_pad  # a branch: row_in is one number
            else:
                s = s + rw
            rh = rh_next.to(tl.float32) * LOG2E
            rh_next = tl.load(rh_ptrs - (row + 1), mask=mask_m & (row + 1 < GRID_H), other=0.0)
            m_new = tl.maximum(m_i, tl.max(s, 1) + rh)
            p = tl.exp2(s - (m_new - rh)[:, None])
            alpha = tl.exp2(m_i - m_new)
            p_sum = tl.sum(p, 1)
            l_i = l_i * alpha + p_sum
            v = tl.load(
                v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask,
                other=kv_other,
            )  # fmt: skip
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            if HAS_BIAS:
                pad_p = pad_p * alpha
                if row_in:
                    if has_pad_col:
                        pad_p += tl.sum(p * pad_col_f[None, :], 1)
                else:
                    pad_p += p_sum
            m_i = m_new
        if HAS_BIAS:
            acc += pad_p[:, None] * bias_v.to(q.dtype).to(tl.float32)[None, :]
        acc = acc / l_i[:, None]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])

    return rel_pos_flash_fwd


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def grid_of(rel_pos_h: Tensor, rel_pos_w: Tensor) -> tuple[int, int]:
    """The `h x w` grid a pair of SAM rel-pos tables (`[2h-1, C]`, `[2w-1, C]`) belongs to."""
    return (rel_pos_h.shape[0] + 1) // 2, (rel_pos_w.shape[0] + 1) // 2


def launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    out: Tensor | None = None,
    *,
    out_strides: tuple[int, int, int] | None = None,
    image: tuple[int, int] | None = None,
    qkv_bias: Tensor | None = None,
    traced: bool = False,
) -> Tensor:
    """Run the kernel: q, k, v `[B, heads, N, C]` (any strides with a contiguous last dim),
    the encoder's rel-pos tables rel_pos_h `[2h-1, C]` and rel_pos_w `[2w-1, C]` ->
    `[B, heads, N, C]`, written into `out` (which may be a strided view) when given, or laid
    out over `out`'s memory by `out_strides` (of the B, heads and N dims).

    Without `image`, the N tokens are the h x w grid (a global block). With `image` =
    (H, W), they are an H x W grid attended in h x w windows (SAM's windowed blocks), the
    windows past the grid's edge padded as Meta's encoder pads them: `qkv_bias` (`[3 *
    heads * C]`, the qkv projection's) gives the padded tokens' keys and values (zeros
    without it).

    The bare launch under the ops below, which is how model code reaches the kernel (an
    opaque op is what torch.compile and CUDA graphs need). Not exported: called directly
    only by the kernel's test and bench/sam_encoder.py, to sweep `KernelConfig`. `traced`
    launches through `torch.library.wrap_triton`, as the export ops below must.
    """
    import triton

    q, k, v, rel_pos_h, rel_pos_w = (
        _last_dim_contiguous(t) for t in (q, k, v, rel_pos_h, rel_pos_w)
    )
    B, heads, n_tokens, head_dim = q.shape
    grid_h, grid_w = grid_of(rel_pos_h, rel_pos_w)
    img_h, img_w = image if image is not None else (grid_h, grid_w)
    if img_h * img_w != n_tokens:
        raise ValueError(f"{n_tokens} tokens do not make a {img_h}x{img_w} grid")
    n_ctx = grid_h * grid_w  # tokens per window
    windows = triton.cdiv(img_h, grid_h) * triton.cdiv(img_w, grid_w)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    ph = max(16, triton.next_power_of_2(2 * grid_h - 1))
    pw = max(16, triton.next_power_of_2(2 * grid_w - 1))
    # each query's products with both tables, written and read back by its own program
    scratch = torch.empty(B * heads, windows, n_ctx, ph + pw, dtype=q.dtype, device=q.device)
    # the k and v thirds of the bias; without one, any pointer the kernel does not write
    # (HAS_BIAS off: never read; not scratch, which a traced launch must see passed once)
    _, bias_k, bias_v = qkv_bias.view(3, -1) if qkv_bias is not None else (rel_pos_h,) * 3
    cfg = KernelConfig
    block_m = cfg.block_m
    block_w = max(16, triton.next_power_of_2(grid_w))
    head_block = triton.next_power_of_2(max(head_dim, 16))
    maxnreg = cfg.maxnreg.get((block_w, head_block))
    q_blocks = triton.cdiv(n_ctx, block_m)
    dense = DENSE_ROWS and dense_rows((grid_h, grid_w), (img_h, img_w), head_dim, block_w, block_m)
    launch_grid = (windows * q_blocks, B * heads)
    kernel = torch.library.wrap_triton(_kernel()) if traced else _kernel()
    kernel[launch_grid](
        q, k, v, rel_pos_h, rel_pos_w, scratch, out, bias_k, bias_v,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        rel_pos_h.stride(0), rel_pos_w.stride(0),
        scratch.stride(0), scratch.stride(1), scratch.stride(2),
        *(out_strides or (out.stride(0), out.stride(1), out.stride(2))),
        heads, n_ctx, head_dim, grid_w, img_h, img_w, q_blocks,
        GRID_H=grid_h, BLOCK_W=block_w, PH=ph, PW=pw,
        HEAD_DIM=head_block, BLOCK_M=block_m,
        # a constant, not an argument: a Python float argument is fp64 to inductor, whose
        # copy of this kernel (torch.compile of `launch`) would then compute in fp64
        QK_SCALE=head_dim**-0.5 * 1.4426950408889634, HAS_BIAS=qkv_bias is not None,
        DENSE=dense,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return out


@torch.library.custom_op("sam_serve::rel_pos_flash", mutates_args=())
def fused_rel_pos_attention(
    qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, out_inv_scale: Tensor | None = None
) -> Tensor:
    """softmax(q k^T / sqrt(C) + rel_h[.., y'] + rel_w[.., x']) v without the dense bias,
    rel_h and rel_w computed inside the kernel from the tables `[2h-1, C]`, `[2w-1, C]`.

    qkv `[B, N, 3, heads, C]` (the qkv projection, reshaped) -> `[B, N, heads * C]`: q, k
    and v are read in place and the output is written token-major, ready for the output
    projection; with `out_inv_scale [heads * C]` int8 by those fixed per-channel scales,
    the projection's input where it takes it so (`models.mlp_static`). An opaque op to
    torch.compile (the kernel is already fused), captured by CUDA graphs.
    """
    return _on_qkv(qkv, rel_pos_h, rel_pos_w, out_inv_scale=out_inv_scale)


def _on_qkv(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    image: tuple[int, int] | None = None,
    qkv_bias: Tensor | None = None,
    traced: bool = False,
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    """The ops' body: q, k and v read in place out of `[B, N, 3, heads, C]`, the output
    written token-major as `[B, N, heads * C]`, ready for the output projection (int8 by
    `out_inv_scale` where given: in the Gluon kernels' epilogue, else a pass after)."""
    if GLUON_GLOBAL and image is None and not traced:
        from models.sam import gluon_attention

        if gluon_attention.gluon_attention_supported(qkv, rel_pos_h, rel_pos_w) is None:
            return gluon_attention.launch_gluon_attention(qkv, rel_pos_h, rel_pos_w,
                                                          out_inv_scale=out_inv_scale)  # fmt: skip
    if GLUON_WINDOW and image is not None and not traced:
        from models.sam import gluon_window_attention as gw

        if gw.gluon_window_supported(qkv, rel_pos_h, rel_pos_w, *image) is None:
            return gw.launch_gluon_window_attention(qkv, rel_pos_h, rel_pos_w, qkv_bias, *image,
                                                    out_inv_scale=out_inv_scale)  # fmt: skip
    out = _output(qkv)
    _, N, _, heads, C = qkv.shape
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # views, each [B, heads, N, C]
    # [B, heads, N, C] written over `out` by strides rather than through a transposed view:
    # a traced launch then mutates a tensor of its own, not a view for the compiler to
    # carry back to its base
    strides = (N * heads * C, C, heads * C)
    launch(
        q, k, v, rel_pos_h, rel_pos_w, out=out, out_strides=strides, image=image,
        qkv_bias=qkv_bias, traced=traced,
    )  # fmt: skip
    if out_inv_scale is not None:  # the Triton kernels write floats: quantised after
        from models.mlp_static import quantize_static

        return quantize_static(out, out_inv_scale)
    return out


def _output(qkv: Tensor, out_inv_scale: Tensor | None = None) -> Tensor:
    B, N, _, heads, C = qkv.shape
    return qkv.new_empty(B, N, heads * C,
                         dtype=qkv.dtype if out_inv_scale is None else torch.int8)  # fmt: skip


@fused_rel_pos_attention.register_fake
def _(
    qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, out_inv_scale: Tensor | None = None
) -> Tensor:
    return _output(qkv, out_inv_scale)


@torch.library.custom_op("sam_serve::rel_pos_flash_windows", mutates_args=())
def fused_window_attention(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    qkv_bias: Tensor | None,
    height: int,
    width: int,
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    """SAM's windowed attention straight on the qkv projection of the whole grid: qkv
    `[B, height * width, 3, heads, C]` -> `[B, height * width, heads * C]`, each token
    attending within its window (the tables' `h x w`), the windows past the grid's edge
    padded as Meta's encoder pads them (keys and values of `qkv_bias`); int8 by
    `out_inv_scale` where given, as `fused_rel_pos_attention`.

    Meta's encoder partitions the normed grid into padded windows, projects 25 windows'
    4,900 tokens to qkv and back (for ViT-B at 1024 px: 64x64 tokens), then crops: here
    the projections see the 4,096 real tokens and no partition or crop copies exist.
    """
    return _on_qkv(qkv, rel_pos_h, rel_pos_w, (height, width), qkv_bias,
                   out_inv_scale=out_inv_scale)  # fmt: skip


@fused_window_attention.register_fake
def _(
    qkv: Tensor,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
    qkv_bias: Tensor | None,
    height: int,
    width: int,
    out_inv_scale: Tensor | None = None,
) -> Tensor:
    return _output(qkv, out_inv_scale)


# The same two ops for torch.export (AOT packages, `models.aot`): a Python custom op cannot
# be called from a package's C++, but a `triton_op`'s body is traced, so the package
# carries the kernel itself, compiled with the rest of the encoder. The compiled
# (`torch.compile`) path keeps the opaque ops above, which it was measured with.


@functools.cache
def exported_ops() -> tuple[Any, Any]:
    """The traceable twins of `fused_rel_pos_attention` and `fused_window_attention`,
    registered at the first call: defining a `triton_op` imports inductor (about a second),
    which a process that never exports should not pay. Call it before loading a saved
    program that uses them; a built package does not need them."""

    @torch.library.triton_op("sam_serve::rel_pos_flash_exported", mutates_args=())
    def rel_pos(
        qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, out_inv_scale: Tensor | None = None
    ) -> Tensor:
        return _on_qkv(qkv, rel_pos_h, rel_pos_w, traced=True, out_inv_scale=out_inv_scale)

    @torch.library.triton_op("sam_serve::rel_pos_flash_windows_exported", mutates_args=())
    def windows(
        qkv: Tensor,
        rel_pos_h: Tensor,
        rel_pos_w: Tensor,
        qkv_bias: Tensor | None,
        height: int,
        width: int,
        out_inv_scale: Tensor | None = None,
    ) -> Tensor:
        return _on_qkv(qkv, rel_pos_h, rel_pos_w, (height, width), qkv_bias, traced=True,
                       out_inv_scale=out_inv_scale)  # fmt: skip

    return rel_pos, windows


def rel_pos_flash(
    qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, out_inv_scale: Tensor | None = None
) -> Tensor:
    """`fused_rel_pos_attention`, or while an AOT package is exported its traceable twin:
    what model code calls."""
    if exporting():
        return exported_ops()[0](qkv, rel_pos_h, rel_pos_w, out_inv_scale)
    return fused_rel_pos_attention(qkv, rel_pos_h, rel_pos_w, out_inv_scale)


def window_flash(
    qkv: Tensor, rel_pos_h: Tensor, rel_pos_w: Tensor, qkv_bias: Tensor | None, height: int,
    width: int, out_inv_scale: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """`fused_window_attention`, or its traceable twin while an AOT package is exported."""
    if exporting():
        return exported_ops()[1](qkv, rel_pos_h, rel_pos_w, qkv_bias, height, width,
                                 out_inv_scale)  # fmt: skip
    return fused_window_attention(qkv, rel_pos_h, rel_pos_w, qkv_bias, height, width,
                                  out_inv_scale)  # fmt: skip
