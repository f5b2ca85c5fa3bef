"""Shared by the Swin tests: the HF reference model on random weights, and key mappings
that write the same weights in timm's and in Microsoft's original checkpoint layouts.

The mappings are written here, independently of `models.swin.checkpoint`, so that the
loader's own mapping is tested against them rather than against itself.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from models.swin import SwinConfig
from models.swin.model import relative_position_index, shift_attention_mask


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-30))


_STUBS = Path(__file__).resolve().parents[1] / "_stubs"


def import_hf_swin() -> ModuleType:
    """`transformers.models.swin.modeling_swin`, imported with the torchvision stand-in hidden.

    tests/models/conftest.py may put a minimal torchvision stand-in (for Meta's
    segment_anything) on `sys.path`; transformers would take it for the real package and
    fail importing names it lacks. It is hidden while transformers decides whether
    torchvision exists (a cached answer), then restored for the SAM tests.
    """
    name = "transformers.models.swin.modeling_swin"
    if name in sys.modules:
        return sys.modules[name]

    def is_stub(module: object) -> bool:
        return str(getattr(module, "__file__", None) or "").startswith(str(_STUBS))

    hidden = {
        k: m
        for k, m in sys.modules.items()
        if (k == "torchvision" or k.startswith("torchvision.")) and is_stub(m)
    }
    saved_path = list(sys.path)
    for key in hidden:
        del sys.modules[key]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _STUBS]
    importlib.invalidate_caches()
    try:
        import_utils = importlib.import_module("transformers.utils.import_utils")
        for value in vars(import_utils).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()  # forget an earlier "torchvision is available"
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved_path
        sys.modules.update(hidden)


def build_hf_swin(config: SwinConfig, seed: int) -> Any:
    """HF `SwinForImageClassification` at our config's sizes, every weight random (seeded)."""
    transformers = import_hf_swin()
    hf_config = transformers.SwinConfig(
        image_size=config.img_size,
        patch_size=config.patch_size,
        num_channels=config.in_chans,
        embed_dim=config.embed_dim,
        depths=list(config.depths),
        num_heads=list(config.num_heads),
        window_size=config.window_size,
        mlp_ratio=config.mlp_ratio,
        qkv_bias=True,
        hidden_act="gelu",
        use_absolute_embeddings=False,
        layer_norm_eps=config.layer_norm_eps,
        num_labels=config.num_classes,
    )
    model = transformers.SwinForImageClassification(hf_config).eval()
    randomize(model, seed)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values for every float tensor of a state dict, chosen by name and shape only.

    Norm weights near 1, biases small, matrices scaled by fan-in, and position-bias tables
    far from timm's near-zero init so that the bias (and its indexing) matters.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        if not t.is_floating_point():
            continue  # old HF versions save relative_position_index (int64)
        if "relative_position_bias_table" in name:
            std, mean = 0.5, 0.0
        elif t.ndim == 1 and name.endswith("weight"):
            std, mean = 0.1, 1.0
        elif t.ndim == 1:
            std, mean = 0.05, 0.0
        else:
            std, mean = t[0].numel() ** -0.5, 0.0
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)


# HF (both the classic and the transformers >= 5 names) -> timm, per block
_HF_BLOCK = [
    (r"layernorm_before\.", "norm1."),
    (r"layernorm_after\.", "norm2."),
    (r"attention\.(self\.|relative_position_bias\.)relative_position_bias_table", "attn.rpb"),
    (r"attention\.(output\.dense|o_proj)\.", "attn.proj."),
    (r"(intermediate\.dense|mlp\.fc1)\.", "mlp.fc1."),
    (r"(output\.dense|mlp\.fc2)\.", "mlp.fc2."),
]
_HF_QKV = re.compile(r"attention\.(self\.(query|key|value)|(q|k|v)_proj)\.(weight|bias)$")


def hf_to_timm(hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF Swin state dict -> timm >= 0.9 keys (query/key/value concatenated into qkv).

    HF merges patches at the END of stage i (`layers.i.downsample`), timm at the START of
    stage i + 1.
    """
    out: dict[str, Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for key, value in hf_state.items():
        if "relative_position_index" in key:
            continue
        if key.startswith("classifier."):
            out["head.fc." + key.removeprefix("classifier.")] = value
            continue
        key = key.removeprefix("swin.")
        key = key.replace("embeddings.patch_embeddings.projection.", "patch_embed.proj.")
        key = key.replace("embeddings.norm.", "patch_embed.norm.")
        key = key.replace("layernorm.", "norm.") if key.startswith("layernorm.") else key
        key = key.removeprefix("encoder.")
        key = re.sub(
            r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) + 1}.downsample.", key
        )
        found = _HF_QKV.search(key)
        if found:
            part = "qkv".index((found[2] or found[3])[0])
            qkv.setdefault((key[: found.start()], found[4]), {})[str(part)] = value
            continue
        for pattern, replacement in _HF_BLOCK:
            key = re.sub(pattern, replacement, key)
        out[key.replace("attn.rpb", "attn.relative_position_bias_table")] = value
    for (prefix, kind), parts in qkv.items():
        out[f"{prefix}attn.qkv.{kind}"] = torch.cat([parts["0"], parts["1"], parts["2"]])
    return out


def timm_to_microsoft(state: dict[str, Tensor], config: SwinConfig) -> dict[str, Any]:
    """timm keys -> Microsoft's original checkpoint: `{"model": state}`, downsample at the end
    of stages 0..n-2, classifier `head`, and the persistent index / mask buffers it saved."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        key = re.sub(
            r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.", key
        )
        out[key.replace("head.fc.", "head.")] = value
    for stage, depth in enumerate(config.depths):
        window = config.stage_window_sizes[stage]
        shift = config.stage_shift_size(stage)
        for block in range(depth):
            prefix = f"layers.{stage}.blocks.{block}."
            out[prefix + "attn.relative_position_index"] = relative_position_index(window)
            if block % 2 and shift:
                res = config.stage_resolutions[stage]
                out[prefix + "attn_mask"] = shift_attention_mask(res, window, shift)
    return {"model": out}
