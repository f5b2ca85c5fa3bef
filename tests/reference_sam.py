"""Meta's reference SAM at the sizes of one of our configs, on seeded random weights.

Shared by the model parity tests and the server's refinement test. Meta's package imports
torchvision; tests/conftest.py puts the test-only stand-in on `sys.path` where no real
torchvision imports.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from models.sam import SamConfig


def build_reference_sam(config: SamConfig) -> Any:
    """Meta's `Sam` assembled from its parts at the sizes of one of our configs."""
    from segment_anything.modeling import (
        ImageEncoderViT,
        MaskDecoder,
        PromptEncoder,
        TwoWayTransformer,
    )
    from segment_anything.modeling import Sam as ReferenceSam

    side = config.embedding_size
    model = ReferenceSam(
        image_encoder=ImageEncoderViT(
            depth=config.encoder_depth,
            embed_dim=config.encoder_embed_dim,
            img_size=config.image_size,
            mlp_ratio=config.mlp_ratio,
            norm_layer=partial(torch.nn.LayerNorm, eps=1e-6),
            num_heads=config.encoder_num_heads,
            patch_size=config.patch_size,
            qkv_bias=True,
            use_rel_pos=True,
            global_attn_indexes=config.encoder_global_attn_indexes,
            window_size=config.window_size,
            out_chans=config.prompt_embed_dim,
        ),
        prompt_encoder=PromptEncoder(
            embed_dim=config.prompt_embed_dim,
            image_embedding_size=(side, side),
            input_image_size=(config.image_size, config.image_size),
            mask_in_chans=config.mask_in_chans,
        ),
        mask_decoder=MaskDecoder(
            num_multimask_outputs=config.num_multimask_outputs,
            transformer=TwoWayTransformer(
                depth=config.decoder_depth,
                embedding_dim=config.prompt_embed_dim,
                mlp_dim=config.decoder_mlp_dim,
                num_heads=config.decoder_num_heads,
            ),
            transformer_dim=config.prompt_embed_dim,
            iou_head_depth=config.iou_head_depth,
            iou_head_hidden_dim=config.iou_head_hidden_dim,
        ),
        pixel_mean=list(config.pixel_mean),
        pixel_std=list(config.pixel_std),
    )
    return model.eval()


@torch.no_grad()
def randomize_reference(model: torch.nn.Module, seed: int) -> None:
    """Random values for every tensor of Meta's state dict, chosen by name and shape only.

    Independent of our own `init_random`: zeros-initialised tensors (rel-pos tables,
    pos_embed, tokens) get non-zero values so that parity covers every term.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        token_like = name.endswith(("_embed.weight", "iou_token.weight", "mask_tokens.weight"))
        if "rel_pos" in name or name.endswith("pos_embed"):
            std, mean = 0.1, 0.0
        elif token_like or "point_embeddings" in name or name.endswith("gaussian_matrix"):
            std, mean = 1.0, 0.0
        elif t.ndim == 1 and name.endswith("weight"):
            std, mean = 0.1, 1.0
        elif t.ndim == 1:
            std, mean = 0.02, 0.0
        elif "output_upscaling" in name:  # ConvTranspose2d [in, out, 2, 2], stride 2
            std, mean = t.shape[0] ** -0.5, 0.0
        else:
            std, mean = t[0].numel() ** -0.5, 0.0
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp(min=1e-30))
