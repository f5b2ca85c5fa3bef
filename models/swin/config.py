"""Swin Transformer v1 configurations: timm's three ImageNet-1k sizes plus a tiny CPU one.

The sizes are those of timm's `swin_{tiny,small,base}_patch4_window7_224` (Microsoft's
released models). The eval transform (input size, crop_pct, interpolation, mean/std) of
timm's pretrained config travels with the model config, so that every caller feeds the
weights the way they were evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "SWIN_CONFIGS", "SwinConfig"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class SwinConfig:
    """Everything needed to build a Swin classifier and to feed it.

    The model sees `[B, in_chans, img_size, img_size]` and returns `[B, num_classes]`.
    Stage `i` works on a `img_size / patch_size / 2**i` square grid with `embed_dim * 2**i`
    channels; stages 1.. start with a 2x2 patch merging.
    """

    name: str
    embed_dim: int
    depths: tuple[int, ...]
    num_heads: tuple[int, ...]
    img_size: int = 224
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 1000
    window_size: int = 7
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-5
    # eval transform (timm's pretrained cfg for these models)
    crop_pct: float = 0.9
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if len(self.depths) != len(self.num_heads) or not self.depths:
            raise ValueError(f"{self.name}: depths and num_heads need one entry per stage")
        if self.img_size % self.patch_size:
            raise ValueError(f"{self.name}: img_size must be a multiple of patch_size")
        for i, (dim, heads) in enumerate(zip(self.stage_dims, self.num_heads, strict=True)):
            if dim % heads:
                raise ValueError(f"{self.name}: stage {i} has {dim} channels for {heads} heads")
        # timm pads grids that do not split evenly into windows or 2x2 merges; none of the
        # released models needs that, so such configs are refused rather than padded
        windows = self.stage_window_sizes
        for i, (res, window) in enumerate(zip(self.stage_resolutions, windows, strict=True)):
            if res % window:
                raise ValueError(f"{self.name}: stage {i} grid {res} is not a multiple of {window}")
            if i + 1 < self.num_stages and res % 2:
                raise ValueError(f"{self.name}: stage {i} grid {res} is odd, cannot merge 2x2")
        if self.interpolation != "bicubic":
            raise ValueError(f"{self.name}: only bicubic interpolation is implemented")

    @property
    def num_stages(self) -> int:
        return len(self.depths)

    @property
    def stage_dims(self) -> tuple[int, ...]:
        """Channels of each stage: the embedding doubles at every patch merging."""
        return tuple(self.embed_dim * 2**i for i in range(self.num_stages))

    @property
    def num_features(self) -> int:
        """Channels entering the classifier (those of the last stage)."""
        return self.stage_dims[-1]

    @property
    def stage_resolutions(self) -> tuple[int, ...]:
        """Side of each stage's token grid: patch merging halves it."""
        grid = self.img_size // self.patch_size
        return tuple(grid // 2**i for i in range(self.num_stages))

    @property
    def stage_window_sizes(self) -> tuple[int, ...]:
        """Window side per stage: a window never exceeds the grid (timm's and Microsoft's rule)."""
        return tuple(min(self.window_size, res) for res in self.stage_resolutions)

    def stage_shift_size(self, stage: int) -> int:
        """Cyclic shift of the odd blocks of a stage; none when one window covers the grid."""
        if self.stage_resolutions[stage] <= self.window_size:
            return 0
        return self.window_size // 2

    @property
    def input_size(self) -> tuple[int, int, int]:
        """(C, H, W) the model expects, as in timm's pretrained cfg."""
        return (self.in_chans, self.img_size, self.img_size)

    @property
    def resize_size(self) -> int:
        """Shorter side after the eval resize, before the center crop: floor(img / crop_pct)."""
        return int(self.img_size / self.crop_pct)

    @classmethod
    def from_name(cls, name: str) -> SwinConfig:
        """Look a config up by name, with an error that lists the valid names."""
        try:
            return SWIN_CONFIGS[name]
        except KeyError:
            valid = ", ".join(sorted(SWIN_CONFIGS))
            raise ValueError(f"unknown Swin model {name!r}; valid names: {valid}") from None


SWIN_CONFIGS: dict[str, SwinConfig] = {
    "swin_tiny_patch4_window7_224": SwinConfig(
        "swin_tiny_patch4_window7_224", 96, (2, 2, 6, 2), (3, 6, 12, 24)
    ),
    "swin_small_patch4_window7_224": SwinConfig(
        "swin_small_patch4_window7_224", 96, (2, 2, 18, 2), (3, 6, 12, 24)
    ),
    "swin_base_patch4_window7_224": SwinConfig(
        "swin_base_patch4_window7_224", 128, (2, 2, 18, 2), (4, 8, 16, 32)
    ),
    # 16x16 then 8x8 token grids in 4x4 windows: both stages shift their odd block (so the
    # shift mask is exercised), stage 1 starts with a patch merging, and a CPU forward
    # takes milliseconds. 1000 classes so that IMAGENET_CLASSES labels still apply.
    "swin_test": SwinConfig(
        "swin_test", 32, (2, 2), (2, 4), img_size=64, patch_size=4, window_size=4
    ),
}
