"""Loading Swin weights: timm state dicts (`.pth` or `.safetensors`), Microsoft's original
checkpoints, or seeded random weights.

As for SAM (`models.sam.checkpoint`): the model is built on the meta device, the file is
memory-mapped, foreign layouts are mapped to timm's keys, every key and shape is checked
before anything is assigned, and only then does `load_state_dict(strict=True,
assign=True)` adopt the tensors. A bad file raises `CheckpointError` (the same class as
SAM's, so callers catch one type) naming the file and the problem.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from models.sam.checkpoint import CheckpointError
from models.state_fit import (
    SHOWN,
    adopt,
    fit_problems,
    non_tensor_entries,
    ready_for_inference,
    unfilled,
)
from models.swin.config import SwinConfig
from models.swin.model import SwinTransformer, WindowAttention

__all__ = ["CheckpointError", "init_random", "load_swin", "to_timm_layout"]

log = logging.getLogger(__name__)
_SAFETENSORS = (".safetensors",)


def load_swin(
    config: SwinConfig, checkpoint: Path | str | None, *, seed: int = 0
) -> SwinTransformer:
    """A `SwinTransformer` on the CPU in fp32, eval mode, gradients off.

    checkpoint: a timm state dict (`.pth`/`.bin` via torch.save, or `.safetensors`), also
    Microsoft's original / timm < 0.9 layout; None gives seeded random weights (the same
    seed gives the same weights).
    """
    with unfilled():
        model = SwinTransformer(config)
    if checkpoint is None:
        model.to_empty(device="cpu")
        init_random(model, seed)
        log.info("Swin %s: random weights (seed %d)", config.name, seed)
    else:
        path = Path(checkpoint)
        state = to_timm_layout(_read_state_dict(path))
        _check_state_dict(path, model, state, config)
        adopt(model, state)
        log.info("Swin %s: weights from %s", config.name, path)
    model.reset_constant_buffers()
    return ready_for_inference(model, f"Swin {config.name}")


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """The file's tensors by name; unwraps the `model` / `state_dict` containers."""
    if not path.is_file():
        raise CheckpointError(f"Swin checkpoint {path}: file not found")
    if path.suffix in _SAFETENSORS:
        state: object = _read_safetensors(path)
    else:
        state = _read_torch(path)
    if isinstance(state, dict):
        # Microsoft wraps its weights as {"model": ...}; training scripts as {"state_dict": ...}
        for container in ("model", "state_dict"):
            inner = state.get(container)
            if isinstance(inner, dict):
                state = inner
    if not isinstance(state, dict) or not state:
        raise CheckpointError(
            f"Swin checkpoint {path}: expected a state dict (dict of tensors), "
            f"got {type(state).__name__}{' (empty)' if isinstance(state, dict) else ''}"
        )
    bad = non_tensor_entries(state)
    if bad:
        raise CheckpointError(
            f"Swin checkpoint {path}: not a state dict of tensors; {len(bad)} entries are not "
            f"tensors, e.g. {bad[:SHOWN]}"
        )
    return state


def _read_torch(path: Path) -> object:
    """torch.load with mmap (falling back to a plain read for legacy, non-zip files)."""
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:
            # mmap only works on the zip format; older torch.save files need a plain read.
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises a zoo here: RuntimeError, UnpicklingError, EOFError
        raise CheckpointError(
            f"Swin checkpoint {path}: not a readable PyTorch checkpoint (truncated, corrupt or "
            f"not a torch.save file): {type(exc).__name__}: {exc}"
        ) from exc


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file (its header is validated against the file size)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # SafetensorError, OSError, ValueError...
        raise CheckpointError(
            f"Swin checkpoint {path}: not a readable safetensors file (truncated, corrupt or "
            f"another format): {type(exc).__name__}: {exc}"
        ) from exc


_OLD_DOWNSAMPLE = re.compile(r"^layers\.(\d+)\.downsample\.")


def to_timm_layout(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map Microsoft's original (and timm < 0.9) keys to timm >= 0.9's; timm keys pass as is.

    The original code merges patches at the END of stages 0..n-2 and names the classifier
    `head`; timm merges at the START of stages 1..n-1 and names it `head.fc`. The original
    also saved `relative_position_index` and `attn_mask` buffers, which we recompute.
    The old layout is recognised by a downsample in stage 0 (as timm's
    `checkpoint_filter_fn` does: the classifier may be absent, so it cannot tell).
    """
    old_layout = "layers.0.downsample.reduction.weight" in state
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.endswith(("relative_position_index", "attn_mask")):
            continue
        if old_layout:
            key = _OLD_DOWNSAMPLE.sub(lambda m: f"layers.{int(m.group(1)) + 1}.downsample.", key)
            if key.startswith("head.") and not key.startswith("head.fc."):
                key = "head.fc." + key.removeprefix("head.")
        out[key] = value
    return out


def _check_state_dict(
    path: Path, model: SwinTransformer, state: dict[str, Tensor], config: SwinConfig
) -> None:
    """Compare keys and shapes with the model; raise one error listing every kind of problem."""
    problems = fit_problems(model, state, config.name)
    if problems:
        raise CheckpointError(
            f"Swin checkpoint {path} does not fit Swin {config.name}: " + " | ".join(problems)
        )


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> None:
    """Deterministic random weights for every parameter (buffers are recomputed, not drawn).

    timm starts position-bias tables near zero and norms at ones/zeros; here every tensor
    gets non-trivial values so that tests exercise every term. Linear/conv weights are
    scaled by fan-in so activations stay O(1) through the depth of the model.
    """
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def normal_(t: Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)
        done.add(id(t))

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            normal_(module.weight, module.weight[0].numel() ** -0.5)
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.LayerNorm):
            normal_(module.weight, 0.1, mean=1.0)
            normal_(module.bias, 0.02)
        elif isinstance(module, WindowAttention):
            normal_(module.relative_position_bias_table, 0.5)
    missed = [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in done]
    if missed:  # a new module type without an init rule would keep to_empty() garbage
        raise RuntimeError(f"init_random has no rule for {missed[:SHOWN]}")
