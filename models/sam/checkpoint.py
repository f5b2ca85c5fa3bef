"""Loading SAM weights: Meta's official `.pth` files, or seeded random weights.

The model is built on the meta device (no memory, no init cost), the checkpoint is
memory-mapped, every key and shape is checked before anything is assigned, and only then
does `load_state_dict(strict=True, assign=True)` adopt the tensors. A bad file raises
`CheckpointError` naming the file and what is wrong; a half-loaded model never escapes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from models.sam.common import LayerNorm2d
from models.sam.config import SamConfig
from models.sam.image_encoder import Attention as EncoderAttention
from models.sam.image_encoder import ImageEncoderViT
from models.sam.prompt_encoder import PositionEmbeddingRandom
from models.sam.sam import Sam
from models.state_fit import (
    SHOWN,
    adopt,
    fit_problems,
    non_tensor_entries,
    ready_for_inference,
    unfilled,
)

__all__ = ["CheckpointError", "init_random", "load_sam"]

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint file that cannot become this model (missing, corrupt or mismatched)."""


def load_sam(config: SamConfig, checkpoint: Path | str | None, *, seed: int = 0) -> Sam:
    """A `Sam` on the CPU in fp32, eval mode, gradients off.

    checkpoint: Meta's official state dict (e.g. `sam_vit_b_01ec64.pth`), or None for
    seeded random weights (the same seed gives the same weights).
    """
    with unfilled():
        model = Sam(config)
    if checkpoint is None:
        model.to_empty(device="cpu")
        init_random(model, seed)
        log.info("SAM %s: random weights (seed %d)", config.name, seed)
    else:
        path = Path(checkpoint)
        state = _read_state_dict(path)
        _check_state_dict(path, model, state, config)
        adopt(model, state)
        log.info("SAM %s: weights from %s", config.name, path)
    model.reset_constant_buffers()
    return ready_for_inference(model, f"SAM {config.name}")


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    """torch.load with mmap (falling back to a plain read for legacy, non-zip files)."""
    if not path.is_file():
        raise CheckpointError(f"SAM checkpoint {path}: file not found")
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError:
            # mmap only works on the zip format; older torch.save files need a plain read.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises a zoo here: RuntimeError, UnpicklingError, EOFError
        raise CheckpointError(
            f"SAM checkpoint {path}: not a readable PyTorch checkpoint (truncated, corrupt or "
            f"not a torch.save file): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(state, dict) or not state:
        raise CheckpointError(
            f"SAM checkpoint {path}: expected a state dict (dict of tensors), "
            f"got {type(state).__name__}"
        )
    bad = non_tensor_entries(state)
    if bad:
        raise CheckpointError(
            f"SAM checkpoint {path}: not a state dict of tensors; {len(bad)} entries are not "
            f"tensors, e.g. {bad[:SHOWN]}"
        )
    return state


def _check_state_dict(path: Path, model: Sam, state: dict[str, Tensor], config: SamConfig) -> None:
    """Compare keys and shapes with the model; raise one error listing every kind of problem."""
    problems = fit_problems(model, state, config.name)
    if problems:
        raise CheckpointError(
            f"SAM checkpoint {path} does not fit SAM {config.name}: " + " | ".join(problems)
        )


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> None:
    """Deterministic random weights for every parameter and persistent buffer.

    Meta initialises several tensors with zeros or ones (relative positions, absolute
    position embedding, norms, biases); here all get non-trivial values so that tests
    exercise every term. Linear/conv weights are scaled by fan-in so activations stay
    O(1) through the depth of the encoder.
    """
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def normal_(t: Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)
        done.add(id(t))

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d | nn.ConvTranspose2d):
            w = module.weight
            # ConvTranspose2d weight is [in, out, k, k]; each output sums `in` inputs here
            # (stride == kernel), Linear/Conv2d sum over all of dims 1..
            fan_in = w.shape[0] if isinstance(module, nn.ConvTranspose2d) else w[0].numel()
            normal_(w, fan_in**-0.5)
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.LayerNorm | LayerNorm2d):
            normal_(module.weight, 0.1, mean=1.0)
            normal_(module.bias, 0.02)
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, 1.0)
        elif isinstance(module, EncoderAttention):
            normal_(module.rel_pos_h, 0.1)
            normal_(module.rel_pos_w, 0.1)
        elif isinstance(module, ImageEncoderViT):
            normal_(module.pos_embed, 0.1)
        elif isinstance(module, PositionEmbeddingRandom):
            normal_(module.positional_encoding_gaussian_matrix, 1.0)
    missed = [name for name, t in model.state_dict(keep_vars=True).items() if id(t) not in done]
    if missed:  # a new module type without an init rule would keep to_empty() garbage
        raise RuntimeError(f"init_random has no rule for {missed[:SHOWN]}")
