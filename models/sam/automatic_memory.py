"""How much device memory automatic mask generation needs, before it runs.

The service calls `estimate_peak_bytes` to refuse a request (413/422) that would not fit,
instead of running out of memory halfway. The bound follows the pipeline's own limits:
chunked decoding, low-res candidates, upscaling and region clean-up in slices of at most
`max_work_bytes`, an NMS overlap matrix built in blocks.
"""

from __future__ import annotations

import torch

from models.images import Size
from models.sam.automatic_ops import NMS_BLOCK_PAIRS, crop_boxes
from models.sam.automatic_types import AutomaticMaskSettings
from models.sam.config import SamConfig

__all__ = ["estimate_peak_bytes", "region_bytes", "upscale_bytes"]

# Live `[P, D, h, w]`-sized activations of the mask decoder per prompt set at its peak
# (the per-set image copy, transformer keys/queries, the upscaling stack). Measured: vit_b
# fp32 on an H100, 256 prompts a chunk, peaked at 8.24 GiB, about 7.9 such activations per
# set; 10 leaves a margin.
_DECODER_ACTIVATIONS = 10
# Bytes of float temporaries per box pair while the NMS overlap matrix is built in blocks.
_NMS_BYTES_PER_PAIR = 40
# Bytes of per-candidate metadata (score, stability, box, point, indices).
_CANDIDATE_META_BYTES = 64


def region_bytes(size: Size) -> int:
    """Device bytes of one mask's small-region clean-up: float labels (float64 past 2^24
    pixels) and their temporaries, int64 pointers, component sizes, bool maps (about 40
    bytes a pixel measured from `automatic_ops.connected_components`; 64 or 96 to be safe)."""
    pixels = size[0] * size[1]
    return pixels * (64 if pixels < 2**24 else 96)


def upscale_bytes(config: SamConfig, crop_size: Size) -> int:
    """Device bytes of one mask's upscaling: the padded-square and the crop-size float32
    logits, the two stability comparisons and the binary mask."""
    S = config.image_size
    ch, cw = crop_size
    return 4 * S * S + 4 * ch * cw + 3 * ch * cw


def estimate_peak_bytes(
    config: SamConfig,
    settings: AutomaticMaskSettings,
    original_size: Size,
    dtype: torch.dtype = torch.float32,
    decoder_activations_extra: int = 0,
) -> int:
    """An upper bound on the device memory one `generate` allocates, besides the weights and
    the image encoder's activations (those of a batch-1 encode, which the service reserves
    for interactive requests anyway).

    Worst case: every candidate passes every filter and survives NMS (cap it with
    `max_masks`). Terms: the uint8 image; per crop its preprocessed input and embedding;
    the low-res logits of all candidates; then the larger of the decoding phase (decoder
    activations of one chunk, one upscaling slice) and the finishing phase (the NMS overlap
    matrix, the full-resolution masks, upscaling or region clean-up slices).
    `decoder_activations_extra`: more live activations per prompt set in a decoder that
    does more than SAM's (SAM 2's high-res skips).
    """
    h, w = original_size
    item = torch.empty((), dtype=dtype).element_size()
    S, e, m = config.image_size, config.embedding_size, config.mask_input_size
    D, outputs = config.prompt_embed_dim, config.num_multimask_outputs
    work = settings.max_work_bytes
    P = settings.points_per_batch
    candidates, decode_peak = 0, 0
    for (x0, y0, x1, y1), layer in crop_boxes(
        original_size, settings.crop_n_layers, settings.crop_overlap_ratio
    ):
        n_side = int(settings.points_per_side / (settings.crop_n_points_downscale_factor**layer))
        n = n_side * n_side
        candidates += outputs * n
        chunk = min(P, n)
        activations = _DECODER_ACTIVATIONS + decoder_activations_extra
        decoder = chunk * (activations * D * e * e + 2 * config.num_mask_tokens * m * m)
        upscale = max(work, upscale_bytes(config, (y1 - y0, x1 - x0)))
        decode_peak = max(decode_peak, decoder * item + outputs * chunk * m * m * item + upscale)
    N = candidates
    # the image, its float copy while a crop is resized, the input batch, the embedding(s)
    resident = h * w * 3 + 12 * h * w + 4 * 3 * S * S + 2 * D * e * e * item
    resident += N * (m * m * item + _CANDIDATE_META_BYTES)
    kept = N if settings.max_masks is None else min(N, settings.max_masks)
    nms = 2 * N * N + _NMS_BYTES_PER_PAIR * min(N * N, max(N, NMS_BLOCK_PAIRS))
    masks = kept * h * w
    finish = max(nms, masks + max(work, upscale_bytes(config, (h, w))))
    if settings.min_mask_region_area > 0:
        regions = max(work, region_bytes((h, w)))
        finish = max(finish, 2 * masks + regions, masks + 2 * kept * kept)
    return resident + max(decode_peak, finish)
