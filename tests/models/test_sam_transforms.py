"""Pre/post-processing on tensors: sizes, jagged batches, coordinates, Meta's conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from segment_anything.utils.transforms import ResizeLongestSide
from torch import Tensor

from models.sam import SAM_CONFIGS, SamConfig
from models.sam.transforms import (
    masks_from_logits,
    postprocess_masks,
    preprocess_images,
    resize_longest_side_size,
    scale_boxes,
    scale_coords,
)

# (H, W): portrait, a 1920x1080 photo scaled down 4x for speed, square at the input size
SIZES = [(300, 200), (270, 480), (256, 256)]


def _image(h: int, w: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


def _jagged(images: list[Tensor]) -> Tensor:
    return torch.nested.nested_tensor([i.reshape(-1, 3) for i in images], layout=torch.jagged)


@pytest.mark.parametrize("name", sorted(SAM_CONFIGS))
@pytest.mark.parametrize("hw", [(300, 200), (1080, 1920), (1, 5000), (1023, 1025), (7, 7)])
def test_resize_size_matches_meta(name: str, hw: tuple[int, int]) -> None:
    target = SAM_CONFIGS[name].image_size
    assert resize_longest_side_size(*hw, target) == ResizeLongestSide.get_preprocess_shape(
        *hw, target
    )


def test_list_and_jagged_batches_are_identical(tiny_config: SamConfig) -> None:
    images = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)]
    from_list, sizes_list = preprocess_images(images, tiny_config, "cpu")
    from_nested, sizes_nested = preprocess_images(
        _jagged(images), tiny_config, "cpu", [(h, w) for h, w in SIZES]
    )
    assert torch.equal(from_list, from_nested)
    assert sizes_list == sizes_nested == [(256, 171), (144, 256), (256, 256)]


def test_mixed_sizes_match_alone_and_pad_with_zeros(tiny_config: SamConfig) -> None:
    images = [_image(h, w, k) for k, (h, w) in enumerate(SIZES)]
    batch, sizes = preprocess_images(images, tiny_config, "cpu")
    assert batch.shape == (3, 3, 256, 256) and batch.dtype == torch.float32
    for k, image in enumerate(images):
        alone, alone_sizes = preprocess_images([image], tiny_config, "cpu")
        assert torch.equal(batch[k : k + 1], alone)
        h, w = sizes[k]
        assert alone_sizes == [(h, w)]
        assert not bool(batch[k, :, h:, :].any()) and not bool(batch[k, :, :, w:].any())


def test_preprocess_matches_meta_normalize_and_pad(reference_sam, tiny_config) -> None:
    """Same float resize as Meta's apply_image_torch, then Meta's normalize + pad."""
    image = _image(300, 200, 9)
    ours, [(h, w)] = preprocess_images([image], tiny_config, "cpu")
    resized = F.interpolate(
        image.permute(2, 0, 1)[None].float(), (h, w), mode="bilinear", antialias=True
    )
    expected = reference_sam.preprocess(resized[0])
    torch.testing.assert_close(ours[0], expected, rtol=1e-6, atol=1e-5)


def test_preprocess_close_to_meta_pil_resize(tiny_config: SamConfig) -> None:
    """The tensor resize stays within about one grey level of Meta's PIL-based apply_image."""
    image = _image(270, 480, 10)
    pil = ResizeLongestSide(256).apply_image(image.numpy())
    ours, [(h, w)] = preprocess_images([image], tiny_config, "cpu")
    assert pil.shape == (h, w, 3)
    std = torch.tensor(tiny_config.pixel_std).view(3, 1, 1)
    mean = torch.tensor(tiny_config.pixel_mean).view(3, 1, 1)
    pixels = ours[0, :, :h, :w] * std + mean
    diff = (pixels - torch.from_numpy(pil).permute(2, 0, 1).float()).abs()
    assert float(diff.mean()) < 1.0


def test_preprocess_rejects_bad_inputs(tiny_config: SamConfig) -> None:
    with pytest.raises(ValueError, match="uint8"):
        preprocess_images([torch.zeros(10, 10, 3)], tiny_config, "cpu")
    with pytest.raises(ValueError, match="size"):
        preprocess_images(_jagged([_image(4, 4, 0)]), tiny_config, "cpu")
    with pytest.raises(ValueError, match="pixels"):
        preprocess_images(_jagged([_image(4, 4, 0)]), tiny_config, "cpu", [(4, 5)])
    with pytest.raises(ValueError, match="lengths"):
        two = _jagged([_image(4, 4, 0), _image(2, 2, 1)])
        preprocess_images(two, tiny_config, "cpu", [(2, 2), (4, 4)])


@pytest.mark.parametrize("original", [(240, 320), (300, 200), (256, 256)])
def test_postprocess_matches_meta(reference_sam, tiny_config, original: tuple[int, int]) -> None:
    low_res = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    input_size = resize_longest_side_size(*original, tiny_config.image_size)
    ours = postprocess_masks(low_res, input_size, original, tiny_config)
    assert ours.shape == (2, 3, *original)
    expected = reference_sam.postprocess_masks(low_res, input_size, original)
    torch.testing.assert_close(ours, expected)
    assert torch.equal(
        masks_from_logits(ours, tiny_config), expected > reference_sam.mask_threshold
    )


@pytest.mark.parametrize("name", sorted(SAM_CONFIGS))
def test_coordinates_scale_as_meta(name: str) -> None:
    config = SAM_CONFIGS[name]
    original = (1080, 1920)
    transform = ResizeLongestSide(config.image_size)
    points = np.array([[0.0, 0.0], [1919.0, 1079.0], [333.3, 777.7]])
    boxes = np.array([[10.0, 20.0, 300.0, 400.0], [0.0, 0.0, 1920.0, 1080.0]])
    expected_points = torch.from_numpy(transform.apply_coords(points, original)).float()
    expected_boxes = torch.from_numpy(transform.apply_boxes(boxes, original)).float()
    assert torch.equal(scale_coords(torch.from_numpy(points), original, config), expected_points)
    # numpy in, numpy out (the service's prompts), the same numbers
    as_numpy = scale_coords(points.astype(np.float32), original, config)
    assert isinstance(as_numpy, np.ndarray) and as_numpy.dtype == np.float32
    expected_f32 = transform.apply_coords(points.astype(np.float32), original).astype(np.float32)
    assert np.array_equal(as_numpy, expected_f32)
    assert torch.equal(scale_boxes(torch.from_numpy(boxes), original, config), expected_boxes)
    assert scale_coords(torch.zeros(0, 2), original, config).shape == (0, 2)
