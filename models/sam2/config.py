"""SAM 2.1 image-model configurations: Meta's four released Hiera sizes plus a tiny one.

The values are those of Meta's `configs/sam2.1/sam2.1_hiera_{t,s,b+,l}.yaml` (trunk sizes,
windows, global-attention blocks, FPN neck) together with the Hiera defaults those files
leave implicit. Only the image path is described: the video memory modules are not built.
Pre-processing constants (square input size, ImageNet mean/std on [0, 1] pixels, mask
threshold) travel with the config so every caller normalises and thresholds alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.sam.config import SamConfig

__all__ = ["SAM2_CONFIGS", "Sam2Config"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Sam2Config:
    """Everything needed to build the SAM 2.1 image path and to feed it.

    The trunk sees `[B, 3, image_size, image_size]`; stage `i` (of 4) runs at stride
    `4 * 2**i` with `embed_dim * 2**i` channels. The neck projects every stage to
    `d_model` channels and drops the coarsest (`scalp`), so the image embedding is the
    stride-16 level and the two finer levels feed the mask decoder's upscaling.
    """

    name: str
    embed_dim: int
    num_heads: int
    stages: tuple[int, int, int, int]
    global_att_blocks: tuple[int, ...]
    window_pos_embed_bkg_spatial_size: tuple[int, int]
    window_spec: tuple[int, int, int, int]
    image_size: int = 1024
    mlp_ratio: float = 4.0
    d_model: int = 256
    fpn_top_down_levels: tuple[int, ...] = (2, 3)
    scalp: int = 1
    mask_in_chans: int = 16
    decoder_depth: int = 2
    decoder_num_heads: int = 8
    decoder_mlp_dim: int = 2048
    num_multimask_outputs: int = 3
    iou_head_depth: int = 3
    iou_head_hidden_dim: int = 256
    # single-mask answers fall back to the best multimask one when this unstable
    stability_delta: float = 0.05
    stability_thresh: float = 0.98
    pixel_mean: tuple[float, float, float] = IMAGENET_MEAN
    pixel_std: tuple[float, float, float] = IMAGENET_STD
    mask_threshold: float = 0.0

    def __post_init__(self) -> None:
        depth = sum(self.stages)
        bad = [i for i in self.global_att_blocks if not 0 <= i < depth]
        if bad:
            raise ValueError(f"{self.name}: global attention blocks out of range: {bad}")
        if self.image_size % 32:
            raise ValueError(f"{self.name}: image_size must be a multiple of 32 (4 stages)")
        if self.scalp != 1:
            raise ValueError(f"{self.name}: only scalp=1 (Meta's value) is implemented")

    @property
    def depth(self) -> int:
        return sum(self.stages)

    @property
    def stage_ends(self) -> tuple[int, ...]:
        """Index of the last block of each stage (where the trunk emits a feature map)."""
        ends, total = [], 0
        for n in self.stages:
            total += n
            ends.append(total - 1)
        return tuple(ends)

    @property
    def backbone_channel_list(self) -> tuple[int, ...]:
        """Trunk output widths, coarsest first (the order of Meta's neck config)."""
        return tuple(self.embed_dim * 2**i for i in reversed(range(len(self.stages))))

    @property
    def backbone_stride(self) -> int:
        """Stride of the image embedding: the coarsest level kept after the scalp."""
        return 4 * 2 ** (len(self.stages) - 1 - self.scalp)

    @property
    def embedding_size(self) -> int:
        """Side of the square image embedding (64 for the released models)."""
        return self.image_size // self.backbone_stride

    @property
    def mask_input_size(self) -> int:
        """Side of the low-resolution masks (decoder output and `mask_input`): 4x embedding."""
        return 4 * self.embedding_size

    @property
    def num_mask_tokens(self) -> int:
        return self.num_multimask_outputs + 1

    def prompt_config(self) -> SamConfig:
        """The SAM config of the prompt side, which SAM 2 keeps from SAM unchanged.

        SAM 2's prompt encoder and two-way transformer are SAM's (same layers, same
        semantics), so `models.sam`'s modules are built from this config instead of being
        written twice. Its encoder fields only satisfy SamConfig's checks: the SAM
        encoder is never built from it.
        """
        return SamConfig(
            name=self.name,
            encoder_embed_dim=self.embed_dim,
            encoder_depth=1,
            encoder_num_heads=1,
            encoder_global_attn_indexes=(),
            image_size=self.image_size,
            patch_size=self.backbone_stride,
            prompt_embed_dim=self.d_model,
            mask_in_chans=self.mask_in_chans,
            decoder_depth=self.decoder_depth,
            decoder_num_heads=self.decoder_num_heads,
            decoder_mlp_dim=self.decoder_mlp_dim,
            num_multimask_outputs=self.num_multimask_outputs,
            iou_head_depth=self.iou_head_depth,
            iou_head_hidden_dim=self.iou_head_hidden_dim,
            mask_threshold=self.mask_threshold,
        )

    @classmethod
    def from_name(cls, name: str) -> Sam2Config:
        """Look a config up by name, with an error that lists the valid names."""
        try:
            return SAM2_CONFIGS[name]
        except KeyError:
            valid = ", ".join(sorted(SAM2_CONFIGS))
            raise ValueError(f"unknown SAM 2 model {name!r}; valid names: {valid}") from None


SAM2_CONFIGS: dict[str, Sam2Config] = {
    "sam2.1_hiera_tiny": Sam2Config(
        "sam2.1_hiera_tiny", 96, 1, (1, 2, 7, 2), (5, 7, 9), (7, 7), (8, 4, 14, 7)
    ),
    "sam2.1_hiera_small": Sam2Config(
        "sam2.1_hiera_small", 96, 1, (1, 2, 11, 2), (7, 10, 13), (7, 7), (8, 4, 14, 7)
    ),
    # b+ keeps Hiera's defaults for stages, windows and global blocks
    "sam2.1_hiera_base_plus": Sam2Config(
        "sam2.1_hiera_base_plus", 112, 2, (2, 3, 16, 3), (12, 16, 20), (14, 14), (8, 4, 14, 7)
    ),
    "sam2.1_hiera_large": Sam2Config(
        "sam2.1_hiera_large", 144, 2, (2, 6, 36, 4), (23, 33, 43), (7, 7), (8, 4, 16, 8)
    ),
    # CPU tests: 256 px, 16x16 embedding. Stage 3's 6-wide windows pad 16 -> 18 (and the
    # q-pooling block after it 8 -> 9), so window padding runs as in the real models.
    "sam2_test_tiny": Sam2Config(
        "sam2_test_tiny", 16, 1, (1, 2, 3, 1), (4,), (7, 7), (8, 4, 6, 3), image_size=256
    ),
}
