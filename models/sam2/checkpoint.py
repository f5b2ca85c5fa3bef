"""Loading Meta's official SAM 2.1 checkpoints (`sam2.1_hiera_*.pt`) into our image path.

The files hold `{"model": state_dict}` for the whole video model. Keys of the image path
(`image_encoder.*`, `sam_prompt_encoder.*`, `sam_mask_decoder.*`, `no_mem_embed`) map to
ours one to one, except the two-way transformer's MLPs, which SAM 2 names
`mlp.layers.{0,1}` and SAM's (reused) layers `mlp.lin{1,2}`. Every other key belongs to the
video modules (memory attention and encoder, object pointers, ...) and is skipped with a
count. Keys and shapes are checked before anything is assigned: a wrong file raises
`Sam2CheckpointError` naming the file and the offending keys, never a half-loaded model.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from models.sam.checkpoint import init_random as init_random_sam
from models.sam2.config import Sam2Config
from models.sam2.model import Sam2
from models.state_fit import (
    SHOWN,
    adopt,
    fit_problems,
    non_tensor_entries,
    ready_for_inference,
    unfilled,
)

__all__ = [
    "IMAGE_PREFIXES",
    "Sam2CheckpointError",
    "init_random",
    "load_sam2",
    "map_checkpoint_keys",
    "to_meta_keys",
]

log = logging.getLogger(__name__)

IMAGE_PREFIXES = ("image_encoder.", "sam_prompt_encoder.", "sam_mask_decoder.", "no_mem_embed")
_MLP_KEY = re.compile(r"^(sam_mask_decoder\.transformer\.layers\.\d+\.mlp\.)layers\.([01])\.")
_OUR_MLP_KEY = re.compile(r"^(sam_mask_decoder\.transformer\.layers\.\d+\.mlp\.)lin([12])\.")


class Sam2CheckpointError(ValueError):
    """A checkpoint file that cannot become this model (missing, corrupt or mismatched)."""


def map_checkpoint_keys(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Meta's keys -> ours for the image path; returns (mapped, skipped video-only keys)."""
    mapped: dict[str, Tensor] = {}
    skipped: list[str] = []
    for key, value in state.items():
        if not key.startswith(IMAGE_PREFIXES):
            skipped.append(key)
            continue
        ours = _MLP_KEY.sub(lambda m: f"{m.group(1)}lin{int(m.group(2)) + 1}.", key)
        mapped[ours] = value
    return mapped, skipped


def to_meta_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our keys -> Meta's (the inverse of `map_checkpoint_keys` on the image path), to
    write files in Meta's format (synthetic weights, benchmarks against Meta's package)."""
    return {
        _OUR_MLP_KEY.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) - 1}.", key): value
        for key, value in state.items()
    }


def load_sam2(config: Sam2Config, checkpoint: Path | str | None, *, seed: int = 0) -> Sam2:
    """A `Sam2` on the CPU in fp32, eval mode, gradients off.

    checkpoint: Meta's official file (e.g. `sam2.1_hiera_base_plus.pt`), or None for seeded
    random weights (the same seed gives the same weights), so that everything but the
    masks' quality can run without a download.
    """
    with unfilled():
        model = Sam2(config)
    if checkpoint is None:
        model.to_empty(device="cpu")
        init_random(model, seed)
        log.info("SAM 2 %s: random weights (seed %d)", config.name, seed)
    else:
        path = Path(checkpoint)
        state, skipped = map_checkpoint_keys(_read_model_state(path))
        _check(path, model, state, config)
        adopt(model, state)
        log.info(
            "SAM 2 %s: %d image-path tensors from %s (%d video-only tensors skipped)",
            config.name,
            len(state),
            path,
            len(skipped),
        )
    return ready_for_inference(model, f"SAM 2 {config.name}")


@torch.no_grad()
def init_random(model: Sam2, seed: int) -> None:
    """Deterministic random weights for every tensor of the image path.

    The prompt encoder and the decoder are SAM's layers plus convolutions, embeddings and
    MLPs, so SAM's rule (fan-in scaled weights, non-trivial norms and embeddings) covers
    them; the trunk adds its two position tables and `no_mem_embed`, which get small
    non-zero values so that every term is exercised.
    """
    init_random_sam(model.sam_prompt_encoder, seed)
    init_random_sam(model.sam_mask_decoder, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    done: set[int] = set()

    def normal_(t: Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)
        done.add(id(t))

    encoder = model.image_encoder
    for module in encoder.modules():
        if isinstance(module, nn.Linear | nn.Conv2d):
            normal_(module.weight, module.weight[0].numel() ** -0.5)
            if module.bias is not None:
                normal_(module.bias, 0.02)
        elif isinstance(module, nn.LayerNorm):
            normal_(module.weight, 0.1, mean=1.0)
            normal_(module.bias, 0.02)
    for table in (encoder.trunk.pos_embed, encoder.trunk.pos_embed_window, model.no_mem_embed):
        normal_(table, 0.1)
    missed = [n for n, t in encoder.state_dict(keep_vars=True).items() if id(t) not in done]
    if missed:  # a new module type without a rule would keep to_empty() garbage
        raise RuntimeError(f"init_random has no rule for image_encoder.{missed[:SHOWN]}")


def _read_model_state(path: Path) -> dict[str, Tensor]:
    """The `model` entry of a `torch.save`d dict, memory-mapped."""
    if not path.is_file():
        raise Sam2CheckpointError(f"SAM 2 checkpoint {path}: file not found")
    try:
        blob = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises a zoo here: RuntimeError, UnpicklingError, EOFError
        raise Sam2CheckpointError(
            f"SAM 2 checkpoint {path}: not a readable PyTorch checkpoint (truncated, corrupt "
            f"or not a torch.save file): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(blob, dict) or not isinstance(blob.get("model"), dict):
        got = sorted(map(str, blob))[:SHOWN] if isinstance(blob, dict) else type(blob).__name__
        raise Sam2CheckpointError(
            f"SAM 2 checkpoint {path}: expected Meta's format {{'model': state_dict}}, got {got}"
        )
    state = blob["model"]
    bad = non_tensor_entries(state)
    if bad:
        raise Sam2CheckpointError(
            f"SAM 2 checkpoint {path}: {len(bad)} entries of 'model' are not tensors, "
            f"e.g. {bad[:SHOWN]}"
        )
    return state


def _check(path: Path, model: Sam2, state: dict[str, Tensor], config: Sam2Config) -> None:
    """Compare keys and shapes with the model; raise one error listing every kind of problem."""
    problems = fit_problems(model, state, config.name, keys="image-path keys", hint="")
    if problems:
        raise Sam2CheckpointError(
            f"SAM 2 checkpoint {path} does not fit {config.name}: " + " | ".join(problems)
        )
