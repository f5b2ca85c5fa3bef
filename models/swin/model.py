"""Swin Transformer v1 (Liu et al. 2021, https://arxiv.org/abs/2103.14030) for inference.

Written for this service after the paper and Microsoft's reference code. Module and
parameter names follow timm >= 0.9 (`patch_embed`, `layers.{i}.downsample` at the start
of stages 1.., `layers.{i}.blocks.{j}.attn.qkv`, `head.fc`), so a timm state dict loads
with `strict=True`; Microsoft's original layout is mapped in `checkpoint.py`.

Inference-only choices: tokens stay `[B, H, W, C]` (channels last) between blocks; on
CUDA the (shifted) window attention is one Triton kernel on the unrolled grid
(`models.swin.window_kernel`: Swin-T 1.77x faster than written out on an H200); elsewhere
it is written out (scores plus the relative position bias and the shifted-window mask,
softmax, weighted sum), which compiled ran 12.6% faster on an H100 than
`F.scaled_dot_product_attention` with the same additive mask (docs/BENCHMARKS.md); the
index and mask tables depend only on the config, so they are computed once as
non-persistent buffers.
Every shape is fixed by the config: no host-device sync and no data-dependent control
flow in `forward`, so `torch.compile(fullgraph=True)` and bf16 work as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.quant_linear import linear_then_residual
from models.swin.config import SwinConfig
from models.swin.window_kernel import kernel_compiles, shifted_window_attention

__all__ = [
    "PatchMerging",
    "SwinBlock",
    "SwinTransformer",
    "WindowAttention",
    "relative_position_index",
    "shift_attention_mask",
    "window_partition",
    "window_reverse",
]

# Added to the logits of query/key pairs from different regions of a shifted window.
# Microsoft and timm use -100 rather than -inf (exp(-100) is 0 in every dtype we use);
# the same value keeps our logits bit-comparable to theirs.
MASKED = -100.0


def window_partition(x: Tensor, window: int) -> Tensor:
    """`[B, H, W, C]` -> `[B, nW, window*window, C]`, windows in row-major order."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    x = x.permute(0, 1, 3, 2, 4, 5)  # [B, H/w, W/w, w, w, C]
    return x.reshape(B, (H // window) * (W // window), window * window, C)


def window_reverse(windows: Tensor, window: int, height: int, width: int) -> Tensor:
    """`[B, nW, window*window, C]` -> `[B, H, W, C]` (the inverse of `window_partition`)."""
    B, _, _, C = windows.shape
    x = windows.view(B, height // window, width // window, window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, height, width, C)


def relative_position_index(window: int, device: torch.device | str | None = None) -> Tensor:
    """`[N, N]` (N = window^2) rows into the `[(2w-1)^2, heads]` bias table.

    Entry (i, j) is `(dy + w - 1) * (2w - 1) + (dx + w - 1)` for the offset (dy, dx) from
    token j to token i, as in Microsoft's code, so their tables are read the same way.
    """
    pos = torch.arange(window, device=device)
    # meshgrid's rows and columns, flattened: (meshgrid itself imports torch._dynamo when
    # run under the meta device, seconds of a start; models.state_fit.unfilled)
    coords = torch.stack((pos.repeat_interleave(window), pos.repeat(window)))  # [2, N]
    rel = coords[:, :, None] - coords[:, None, :] + (window - 1)  # [2, N, N]
    return rel[0] * (2 * window - 1) + rel[1]


def shift_attention_mask(
    res: int, window: int, shift: int, device: torch.device | str | None = None
) -> Tensor:
    """`[nW, N, N]` additive mask for shifted windows on a `res x res` grid.

    After the cyclic shift, windows on the last row/column hold tokens from up to three
    regions per axis that were not neighbours in the image; pairs from different regions
    get `MASKED`, pairs from the same region 0.
    """
    idx = torch.arange(res, device=device)
    region = (idx >= res - window).long() + (idx >= res - shift).long()  # [res] in {0, 1, 2}
    label = region[:, None] * 3 + region[None, :]  # [res, res]
    windows = window_partition(label[None, :, :, None], window)[0, :, :, 0]  # [nW, N]
    differs = windows[:, None, :] != windows[:, :, None]  # [nW, N, N]
    return torch.zeros(differs.shape, device=device).masked_fill(differs, MASKED)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window, with a learned relative position bias.

    `form` picks how it runs. "kernel": one Triton kernel on the block's unrolled grid
    (`models.swin.window_kernel`; `SwinBlock.forward` takes that path, as the kernel does
    the roll and the windows itself). "matmul": written out, which inductor fuses the bias
    add into the softmax of; compiled on an H100 (fp16, batch 1024) 10,783 img/s against
    "sdpa"'s 9,572 (SDPA pads a 49-token window to 64 and reads the bias as a separate
    mask). "auto": the kernel where it runs compiled (CUDA with Triton), else "matmul".
    `bench/swin.py --attention` compares them.
    """

    form: str = "auto"

    def __init__(self, dim: int, num_heads: int, window: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.window = window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # one learned scalar per head for each of the (2w-1)^2 possible offsets
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window - 1) ** 2, num_heads)
        )
        self.register_buffer(
            "relative_position_index", relative_position_index(window), persistent=False
        )
        self.relative_position_index: Tensor

    def reset_constant_buffers(self, device: torch.device) -> None:
        self.relative_position_index = relative_position_index(self.window, device)

    def chosen_form(self, device: torch.device) -> str:
        """The form this call runs in on `device` ("auto" resolved)."""
        if self.form != "auto":
            return self.form
        return "kernel" if kernel_compiles(device) else "matmul"

    def on_grid(self, x: Tensor, shift: int) -> Tensor:
        """The kernel's path: x `[B, H, W, C]`, the normed and *unrolled* grid -> the
        attention output on the same grid `[B, H, W, C]`, projected."""
        qkv = self.qkv(x)  # [B, H, W, 3C]: per token, so the windows need no copy
        heads, window = self.num_heads, self.window
        table = self.relative_position_bias_table
        return self.proj(shifted_window_attention(qkv, table, heads, window, shift))

    def position_bias(self) -> Tensor:
        """`[heads, N, N]` bias gathered from the table (a gather: no sync, compiles)."""
        N = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(N, N, self.num_heads).permute(2, 0, 1)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x `[B, nW, N, C]`, mask `[nW, N, N]` additive or None -> `[B, nW, N, C]`.

        Windows and heads share one head axis (`[B, nW*heads, N, d]`), so the additive
        mask `[1, nW*heads, N, N]` broadcasts over the batch instead of being copied per image.
        """
        # the width from the projection: x may be packed quantised rows (models.ln_quant)
        B, nW, N = x.shape[:3]
        C = self.proj.out_features
        heads = self.num_heads
        qkv = self.qkv(x).view(B, nW, N, 3, heads, C // heads)
        qkv = qkv.permute(3, 0, 1, 4, 2, 5).reshape(3, B, nW * heads, N, C // heads)
        q, k, v = qkv.unbind(0)  # each [B, nW*heads, N, d]
        bias = self.position_bias()  # [heads, N, N]
        # [nW, heads, N, N]: the shift mask (if any) per window, the bias per head
        bias = bias.expand(nW, heads, N, N) if mask is None else bias[None] + mask[:, None]
        attn_mask = bias.reshape(1, nW * heads, N, N).to(q.dtype)
        if self.form == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, nW*h, N, d]
        else:
            scores = (q * (C // heads) ** -0.5) @ k.transpose(-2, -1) + attn_mask
            out = scores.softmax(-1) @ v
        out = out.view(B, nW, heads, N, C // heads).transpose(2, 3).reshape(B, nW, N, C)
        return self.proj(out)


class Mlp(nn.Module):
    """The transformer MLP: Linear -> GELU (exact) -> Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """`fc2(act(fc1(x)))`, plus `residual` if given (in fc2's epilogue where a
        quantised fc2 fuses it)."""
        return linear_then_residual(self.fc2, self.act(self.fc1(x)), residual)


class SwinBlock(nn.Module):
    """Pre-norm block: (shifted) window attention, then MLP, each with a residual."""

    def __init__(self, config: SwinConfig, stage: int, shifted: bool) -> None:
        super().__init__()
        dim = config.stage_dims[stage]
        eps = config.layer_norm_eps
        self.res = config.stage_resolutions[stage]
        self.window = config.stage_window_sizes[stage]
        self.shift = config.stage_shift_size(stage) if shifted else 0
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = WindowAttention(dim, config.num_heads[stage], self.window)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio))
        self.register_buffer("attn_mask", self._mask(None), persistent=False)
        self.attn_mask: Tensor | None

    def _mask(self, device: torch.device | None) -> Tensor | None:
        if not self.shift:
            return None
        return shift_attention_mask(self.res, self.window, self.shift, device)

    def reset_constant_buffers(self, device: torch.device) -> None:
        self.attn_mask = self._mask(device)

    def forward(self, x: Tensor) -> Tensor:
        """`[B, H, W, C]` -> `[B, H, W, C]`."""
        H, W = x.shape[1:3]
        y = self.norm1(x)
        if self.attn.chosen_form(x.device) == "kernel":
            return self._mlp(x + self.attn.on_grid(y, self.shift))
        if self.shift:  # fixed by the config, not by the data
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        windows = self.attn(window_partition(y, self.window), self.attn_mask)  # [B, nW, N, C]
        y = window_reverse(windows, self.window, H, W)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        return self._mlp(x + y)

    def _mlp(self, x: Tensor) -> Tensor:
        return self.mlp(self.norm2(x), residual=x)  # x + mlp(norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens concatenated (4C), normalized, projected to 2C.

    The concatenation order is Microsoft's (x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2],
    x[1::2, 1::2]) so that their `reduction` weights apply unchanged.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim, eps=eps)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """`[B, H, W, C]` -> `[B, H/2, W/2, 2C]`."""
        B, H, W, C = x.shape
        # [B, H/2, dy, W/2, dx, C] -> [B, H/2, W/2, dx, dy, C]: dy varies fastest, as above
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """Optional patch merging (stages 1..), then blocks alternating plain / shifted windows."""

    def __init__(self, config: SwinConfig, stage: int) -> None:
        super().__init__()
        self.downsample: nn.Module = (
            PatchMerging(config.stage_dims[stage - 1], config.layer_norm_eps)
            if stage > 0
            else nn.Identity()
        )
        self.blocks = nn.Sequential(
            *(SwinBlock(config, stage, shifted=j % 2 == 1) for j in range(config.depths[stage]))
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(self.downsample(x))


class PatchEmbed(nn.Module):
    """Non-overlapping `patch x patch` patches -> tokens `[B, H/p, W/p, C]`, normalized."""

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(config.in_chans, config.embed_dim, kernel_size=p, stride=p)
        self.norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class ClassifierHead(nn.Module):
    """Global average pool over the token grid, then the linear classifier (timm's `head.fc`)."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.mean(dim=(1, 2)))  # [B, H, W, C] -> [B, num_classes]


class SwinTransformer(nn.Module):
    """Swin v1 classifier: `[B, 3, S, S]` normalized pixels -> logits `[B, num_classes]`."""

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.layers = nn.Sequential(*(SwinStage(config, i) for i in range(config.num_stages)))
        self.norm = nn.LayerNorm(config.num_features, eps=config.layer_norm_eps)
        self.head = ClassifierHead(config.num_features, config.num_classes)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def reset_constant_buffers(self) -> None:
        """Recompute the index and mask buffers (needed after a meta-device build)."""
        device = self.patch_embed.proj.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        for module in self.modules():
            if isinstance(module, WindowAttention | SwinBlock):
                module.reset_constant_buffers(device)
        # a model already cast (e.g. to bf16) keeps its masks in the same dtype
        for block in self.modules():
            if isinstance(block, SwinBlock) and block.attn_mask is not None:
                block.attn_mask = block.attn_mask.to(self.dtype)

    def forward_features(self, x: Tensor) -> Tensor:
        """`[B, 3, S, S]` -> normalized last-stage tokens `[B, s, s, num_features]`.

        s = S / patch_size / 2^(num_stages - 1): 7 for the released models at 224.
        """
        size = self.config.img_size
        if x.ndim != 4 or tuple(x.shape[1:]) != (self.config.in_chans, size, size):
            raise ValueError(
                f"{self.config.name} expects [B, {self.config.in_chans}, {size}, {size}], "
                f"got {tuple(x.shape)}"
            )
        x = self.patch_embed(x.to(self.dtype))  # [B, S/p, S/p, C]
        x = self.layers(x)  # [B, S/p/2^(n-1), ..., C * 2^(n-1)]
        return self.norm(x)

    def forward(self, x: Tensor) -> Tensor:
        """`[B, 3, S, S]` normalized pixels -> logits `[B, num_classes]` in the model's dtype."""
        return self.head(self.forward_features(x))
