"""Prompt sets and their padded batch form for the mask decoder.

A `PromptSet` is one request's prompt on one image. `pack_prompts` turns many of them
(for many images) into one `PromptBatch` of fixed-shape tensors: each set is first
canonicalised as Meta's prompt encoder does, then padded to the longest set with tokens
that the decoder masks out. All the host-side decisions (lengths, which sets have a box
or a mask) are taken here, so the forward pass never looks at tensor values.

Canonical tokens of one set (coordinates in the model input frame):
- points and box: the points, then the box's two corners;
- points only: the points, then one "not a point" token at (0, 0) (Meta's `pad=True`);
- box only: the two corners;
- neither: no tokens (only the decoder's output tokens and the dense prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.images import upload
from models.sam.prompt_encoder import LABEL_BOX_BR, LABEL_BOX_TL, LABEL_NOT_A_POINT, LABEL_PAD

__all__ = ["PromptBatch", "PromptSet", "pack_masks", "pack_prompts", "prompt_tokens"]


@dataclass(frozen=True)
class PromptSet:
    """One prompt on one image, coordinates already scaled to the model input frame.

    points: `[N, 2]` (x, y), may be empty; labels: `[N]` (1 foreground, 0 background,
    -1 ignored point); box: `[4]` (x0, y0, x1, y1) or None; mask_input: `[1, 4h, 4w]`
    low-res logits from an earlier prediction, or None. Host tensors, numpy arrays or
    nested lists.
    """

    points: Tensor | np.ndarray | Sequence[Sequence[float]] = ()
    labels: Tensor | np.ndarray | Sequence[int] = ()
    box: Tensor | np.ndarray | Sequence[float] | None = None
    mask_input: Tensor | None = None


@dataclass(frozen=True)
class PromptBatch:
    """P prompt sets padded to T tokens each, on the decoding device.

    image_index: `[P]` int64, which embedding each set decodes against; or None when the
    embeddings given to `Sam.decode` are already one row per set (no gather, no copy).
    points: `[P, T, 2]` float32 token coordinates (box corners included).
    point_labels: `[P, T]` int64: -2 padding, -1 not a point, 0/1 point, 2/3 box corners.
    token_valid: `[P, T]` bool, False on padding tokens (masked out of attention).
    mask_input: `[P, 1, 4h, 4w]` float32 and has_mask_input: `[P]` bool, or both None when
    no set in the batch has a mask input (the common case skips the mask convolutions).
    """

    image_index: Tensor | None
    points: Tensor
    point_labels: Tensor
    token_valid: Tensor
    mask_input: Tensor | None = None
    has_mask_input: Tensor | None = None

    @property
    def num_sets(self) -> int:
        return self.points.shape[0]

    def to(self, device: torch.device | str) -> PromptBatch:
        """The same batch on another device (tensors copied, shapes unchanged)."""

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else upload(t, device)

        return PromptBatch(
            move(self.image_index),
            upload(self.points, device),
            upload(self.point_labels, device),
            upload(self.token_valid, device),
            move(self.mask_input),
            move(self.has_mask_input),
        )


def canonical_tokens(prompt: PromptSet) -> tuple[Tensor, Tensor]:
    """One set's tokens as Meta's prompt encoder builds them: (`[T, 2]` float32, `[T]` int64)."""
    points, labels = prompt_tokens(prompt)
    return torch.from_numpy(points), torch.from_numpy(labels)


def prompt_tokens(prompt: PromptSet) -> tuple[np.ndarray, np.ndarray]:
    """`canonical_tokens` in numpy: the GPU worker packs every prompt of a batch while
    holding the GIL, and the small torch ops this took per prompt were about 8% of the GIL's
    busy time under load (py-spy, H100 host); numpy does the same in about a quarter of
    the time (13 against 57 us per box-and-point set on our 2-core CPU)."""
    points = np.asarray(prompt.points, dtype=np.float32).reshape(-1, 2)
    labels = np.asarray(prompt.labels, dtype=np.int64).reshape(-1)
    if points.shape[0] != labels.shape[0]:
        raise ValueError(f"{points.shape[0]} points but {labels.shape[0]} labels")
    if labels.size and not bool(((labels >= -1) & (labels <= 1)).all()):
        raise ValueError("point labels must be 1 (foreground), 0 (background) or -1 (ignore)")
    if prompt.box is not None:
        box = np.asarray(prompt.box, dtype=np.float32)
        if box.size != 4:
            raise ValueError(f"a box has 4 coordinates, got shape {tuple(box.shape)}")
        extra, extra_labels = box.reshape(2, 2), [LABEL_BOX_TL, LABEL_BOX_BR]
    elif points.shape[0] > 0:
        extra, extra_labels = np.zeros((1, 2), np.float32), [LABEL_NOT_A_POINT]
    else:
        return points, labels
    return (
        np.concatenate([points, extra]),
        np.concatenate([labels, np.asarray(extra_labels, dtype=np.int64)]),
    )


def pack_prompts(
    sets: Sequence[PromptSet],
    image_index: Sequence[int] | Tensor | None,
    device: torch.device | str,
    mask_size: int | None = None,
) -> PromptBatch:
    """Canonicalise and pad prompt sets into one `PromptBatch` on `device`.

    `image_index[p]` names the embedding (row of the `embeddings` given to `Sam.decode`)
    that set p decodes against; a tensor already on the device is used as is, so no
    host round trip is needed. None: the embeddings will be one row per set, so nothing
    needs gathering. With `mask_size`, a batch without mask inputs still carries a zero
    `[P, 1, m, m]` mask input flagged absent (the same result, one graph shape).
    """
    if not sets:
        raise ValueError("pack_prompts needs at least one prompt set")
    if image_index is not None and len(image_index) != len(sets):
        raise ValueError(f"{len(sets)} prompt sets but {len(image_index)} image indexes")
    tokens = [prompt_tokens(s) for s in sets]
    P, T = len(sets), max(t[0].shape[0] for t in tokens)
    points_np = np.zeros((P, T, 2), dtype=np.float32)
    labels_np = np.full((P, T), LABEL_PAD, dtype=np.int64)
    for p, (coords, kinds) in enumerate(tokens):
        points_np[p, : coords.shape[0]] = coords
        labels_np[p, : kinds.shape[0]] = kinds
    points, labels = torch.from_numpy(points_np), torch.from_numpy(labels_np)
    mask_input, has_mask = pack_masks(sets)
    if mask_input is None and mask_size is not None:
        # A compiled decoder gets a mask input always (zeros, flagged absent): one graph for
        # every prompt form, refinement included, instead of one more per form to warm up.
        mask_input = torch.zeros(P, 1, mask_size, mask_size, device=device)
        has_mask = torch.zeros(P, dtype=torch.bool)
    batch = PromptBatch(
        image_index=None
        if image_index is None
        else torch.as_tensor(image_index, dtype=torch.int64),
        points=points,
        point_labels=labels,
        token_valid=labels != LABEL_PAD,
        mask_input=mask_input,
        has_mask_input=has_mask,
    )
    return batch.to(device)


def pack_masks(sets: Sequence[PromptSet]) -> tuple[Tensor | None, Tensor | None]:
    """Stack the sets' mask inputs (`[P, 1, m, m]`, zeros where absent) and their presence."""
    given = [s.mask_input for s in sets if s.mask_input is not None]
    if not given:
        return None, None
    shape = tuple(given[0].shape[-2:])
    # built where the given masks live: a mask kept on the device never makes a round trip
    masks = torch.zeros(len(sets), 1, *shape, device=given[0].device)
    has_mask = torch.zeros(len(sets), dtype=torch.bool)
    for p, s in enumerate(sets):
        if s.mask_input is None:
            continue
        if tuple(s.mask_input.shape[-2:]) != shape or s.mask_input.numel() != masks[p].numel():
            raise ValueError(f"mask inputs must all be [1, {shape[0]}, {shape[1]}]")
        masks[p] = s.mask_input.reshape(1, *shape).to(masks.device).float()
        has_mask[p] = True
    return masks, has_mask
