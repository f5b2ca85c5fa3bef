"""SAM model configurations: Meta's three released sizes plus a tiny one for CPU tests.

The sizes of ViT-B/L/H are those of Meta's `build_sam.py`; the pre-processing constants
(input size, pixel mean/std, mask threshold) travel with the config so that every caller
normalizes and thresholds the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SAM_CONFIGS", "SamConfig"]

PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)


@dataclass(frozen=True)
class SamConfig:
    """Everything needed to build a SAM model and to feed it.

    The image encoder sees `[B, 3, image_size, image_size]` and returns
    `[B, prompt_embed_dim, image_size / patch_size, image_size / patch_size]`.
    """

    name: str
    encoder_embed_dim: int
    encoder_depth: int
    encoder_num_heads: int
    encoder_global_attn_indexes: tuple[int, ...]
    image_size: int = 1024
    patch_size: int = 16
    window_size: int = 14
    mlp_ratio: float = 4.0
    prompt_embed_dim: int = 256
    mask_in_chans: int = 16
    decoder_depth: int = 2
    decoder_num_heads: int = 8
    decoder_mlp_dim: int = 2048
    num_multimask_outputs: int = 3
    iou_head_depth: int = 3
    iou_head_hidden_dim: int = 256
    pixel_mean: tuple[float, float, float] = PIXEL_MEAN
    pixel_std: tuple[float, float, float] = PIXEL_STD
    mask_threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"{self.name}: image_size must be a multiple of patch_size")
        if self.encoder_embed_dim % self.encoder_num_heads:
            raise ValueError(f"{self.name}: encoder_num_heads must divide encoder_embed_dim")
        bad = [i for i in self.encoder_global_attn_indexes if not 0 <= i < self.encoder_depth]
        if bad:
            raise ValueError(f"{self.name}: global attention indexes out of range: {bad}")

    @property
    def embedding_size(self) -> int:
        """Side of the square image embedding (64 for the released models)."""
        return self.image_size // self.patch_size

    @property
    def mask_input_size(self) -> int:
        """Side of the low-resolution masks (decoder output and `mask_input`): 4x embedding."""
        return 4 * self.embedding_size

    @property
    def num_mask_tokens(self) -> int:
        """Mask tokens of the decoder: one single-mask token plus the multimask ones."""
        return self.num_multimask_outputs + 1

    @classmethod
    def from_name(cls, name: str) -> SamConfig:
        """Look a config up by name, with an error that lists the valid names."""
        try:
            return SAM_CONFIGS[name]
        except KeyError:
            valid = ", ".join(sorted(SAM_CONFIGS))
            raise ValueError(f"unknown SAM model {name!r}; valid names: {valid}") from None


SAM_CONFIGS: dict[str, SamConfig] = {
    "vit_b": SamConfig("vit_b", 768, 12, 12, (2, 5, 8, 11)),
    "vit_l": SamConfig("vit_l", 1024, 24, 16, (5, 11, 17, 23)),
    "vit_h": SamConfig("vit_h", 1280, 32, 16, (7, 15, 23, 31)),
    # 16x16 embedding with 6x6 windows: window padding (16 -> 18) is exercised as in the
    # real models (64 -> 70), while a CPU forward takes milliseconds.
    "vit_tiny": SamConfig("vit_tiny", 64, 2, 2, (1,), image_size=256, patch_size=16, window_size=6),
}
