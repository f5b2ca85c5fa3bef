"""Swin pre-processing on tensors against timm's PIL eval transform (Resize shorter side
to int(S / crop_pct), bicubic; CenterCrop S; ToTensor; Normalize), and jagged batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from models.images import jagged_on, nested_pixels
from models.swin import SWIN_CONFIGS, SwinConfig
from models.swin import transforms as swin_tf
from tests.conftest import PHOTOS

TINY = SWIN_CONFIGS["swin_tiny_patch4_window7_224"]


def _pil_reference(image: Image.Image, config: SwinConfig) -> Tensor:
    """timm's eval transform on a PIL image, with torchvision's size and crop rules."""
    w, h = image.size
    short = int(config.img_size / config.crop_pct)
    size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    resized = image.resize(size, Image.Resampling.BICUBIC)
    S = config.img_size
    top = round((size[1] - S) / 2.0)  # Python's round, as torchvision
    left = round((size[0] - S) / 2.0)
    crop = np.asarray(resized)[top : top + S, left : left + S]
    x = torch.from_numpy(crop.copy()).permute(2, 0, 1).float() / 255
    mean = torch.tensor(config.mean).view(3, 1, 1)
    std = torch.tensor(config.std).view(3, 1, 1)
    return (x - mean) / std


def _to_tensor(image: Image.Image) -> Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy())


def _random(h: int, w: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


def _levels(x: Tensor, config: SwinConfig) -> Tensor:
    """Normalized `[..., 3, S, S]` back to 0..255 levels."""
    mean = torch.tensor(config.mean).view(3, 1, 1)
    std = torch.tensor(config.std).view(3, 1, 1)
    return (x * std + mean) * 255


@pytest.fixture(scope="module")
def dog() -> Image.Image:
    path = PHOTOS / "dog.jpg"
    return Image.open(path).convert("RGB")


@pytest.mark.parametrize("variant", ["landscape", "portrait", "small_upscaled"])
@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swin_test"])
def test_matches_pil_on_a_real_photo(dog: Image.Image, variant: str, name: str) -> None:
    config = SWIN_CONFIGS[name]
    image = {
        "landscape": dog,  # 800x534: downscale, crop columns
        "portrait": dog.transpose(Image.Transpose.ROTATE_90),  # 534x800: crop rows
        "small_upscaled": dog.crop((300, 150, 420, 230)),  # 120x80: upscale
    }[variant]
    expected = _pil_reference(image, config)
    actual = swin_tf.preprocess_images([_to_tensor(image)], config, "cpu")[0]
    diff = (_levels(actual, config) - _levels(expected, config)).abs()
    # PIL's fixed-point weights: a few pixels differ by one level (0.04% when downscaling,
    # 0.6% when upscaling this crop 3x), none by more
    assert float(diff.max()) < 1.01
    assert float((diff > 0.5).float().mean()) < 0.01


SIZES = [(534, 800), (300, 200), (248, 248), (224, 224), (40, 30), (1, 7)]


@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "swin_test"])
def test_list_and_nested_batch_agree(name: str) -> None:
    config = SWIN_CONFIGS[name]
    images = [_random(h, w, seed=k) for k, (h, w) in enumerate(SIZES)]
    from_list = swin_tf.preprocess_images(images, config, "cpu")
    nested = nested_pixels(images, "cpu")
    from_nested = swin_tf.preprocess_images(nested, config, torch.device("cpu"), SIZES)
    assert torch.equal(from_list, from_nested)
    # each image alone gives the same as in the batch
    for k, image in enumerate(images):
        assert torch.equal(swin_tf.preprocess_images([image], config, "cpu")[0], from_list[k])


def test_device_packing_equals_host_nested_tensor() -> None:
    """The accelerator path (values allocated on the device, filled slice by slice) builds
    the same jagged tensor as `torch.nested.nested_tensor` does on the host; run here with
    the host as the target, since CI has no GPU."""
    images = [_random(h, w, seed=k) for k, (h, w) in enumerate(SIZES)]
    rows = [image.reshape(-1, 3) for image in images]
    packed = jagged_on(rows, torch.device("cpu"))
    reference = nested_pixels(images, "cpu")
    assert packed.is_nested and packed.layout == torch.jagged
    assert torch.equal(packed.values(), reference.values())
    assert torch.equal(packed.offsets(), reference.offsets())
    from_packed = swin_tf.preprocess_images(packed, TINY, torch.device("cpu"), SIZES)
    assert torch.equal(from_packed, swin_tf.preprocess_images(images, TINY, "cpu"))


def _read_only(h: int, w: int) -> np.ndarray:
    source = np.arange(h * w * 3, dtype=np.uint8).reshape(h, w, 3)
    source.flags.writeable = False  # what np.asarray(PIL image) gives
    return source


def test_nested_batch_needs_matching_sizes() -> None:
    images = [_random(10, 12, 0), _random(9, 9, 1)]
    nested = nested_pixels(images, "cpu")
    with pytest.raises(ValueError):
        swin_tf.preprocess_images(nested, TINY, "cpu", [(10, 12), (9, 8)])


def test_output_shape_dtype_and_normalization() -> None:
    color = torch.tensor([200, 30, 120], dtype=torch.uint8)
    images = [color.expand(h, w, 3).contiguous() for h, w in [(300, 500), (224, 224), (50, 60)]]
    out = swin_tf.preprocess_images(images, TINY, "cpu")
    assert out.shape == (3, 3, 224, 224)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    # a flat colour stays flat through resize and crop, then (v / 255 - mean) / std
    expected = (color.float() / 255 - torch.tensor(TINY.mean)) / torch.tensor(TINY.std)
    torch.testing.assert_close(out, expected.view(1, 3, 1, 1).expand_as(out), rtol=0, atol=1e-6)
    assert swin_tf.preprocess_images([], TINY, "cpu").shape == (0, 3, 224, 224)


def test_size_and_crop_rules() -> None:
    assert TINY.resize_size == 248  # floor(224 / 0.9)
    assert SWIN_CONFIGS["swin_test"].resize_size == 71  # floor(64 / 0.9)
    assert swin_tf.resize_shorter_side_size(534, 800, 248) == (248, 371)  # 371.53 truncated
    assert swin_tf.resize_shorter_side_size(800, 534, 248) == (371, 248)
    assert swin_tf.resize_shorter_side_size(100, 100, 248) == (248, 248)
    # Python's round, as torchvision's CenterCrop: half to even
    assert swin_tf.center_crop_offsets(249, 251, 224) == (12, 14)
    assert swin_tf.center_crop_offsets(371, 248, 224) == (74, 12)


@pytest.mark.parametrize(
    "image",
    [
        torch.zeros(10, 10, 3),  # float
        torch.zeros(10, 10, 4, dtype=torch.uint8),  # RGBA
        torch.zeros(10, 10, dtype=torch.uint8),  # grey
        torch.zeros(0, 10, 3, dtype=torch.uint8),  # empty
    ],
)
def test_rejects_bad_images(image: Tensor) -> None:
    with pytest.raises(ValueError, match="image 0"):
        swin_tf.preprocess_images([image], TINY, "cpu")
