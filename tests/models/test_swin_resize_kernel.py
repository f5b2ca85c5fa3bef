"""The batched Swin pre-processing kernels (`models/swin/resize_kernel.py`) against Pillow,
timm's reference, and against the per-image tensor path the engine used before.

CI has no GPU, so the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py): the same kernel source, on the CPU.
"""

from __future__ import annotations

import numpy as np
import PIL
from PIL import Image

from models.swin import SWIN_CONFIGS
from models.swin.resize_kernel import PRECISION_BITS, pil_coefficients
from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import numpy as np
import torch
from PIL import Image
from models.swin import SWIN_CONFIGS
from models.swin import transforms as swin_tf
from models.swin.resize_kernel import preprocess_packed
from tests.conftest import PHOTOS

from models.swin.resize_kernel import PRECISION_BITS as PB, pil_coefficients


def axis(arr, in_size, out_size, start, count):
    # one pass along axis -2 of `arr`, in Pillow's fixed point
    first, taps, w = pil_coefficients(in_size, out_size, start, count)
    sums = np.full(arr.shape[:-2] + (count, 3), 1 << (PB - 1), dtype=np.int64)
    for t in range(w.shape[1]):
        x = np.minimum(first + t, in_size - 1)
        sums += np.where((t < taps)[:, None], arr[..., x, :].astype(np.int64) * w[:, t, None], 0)
    return np.clip(sums >> PB, 0, 255)


def two_pass(img, new, crop_at, S):
    # the kernels' arithmetic in numpy: horizontal pass (the crop's columns), then vertical
    (h, w), (newh, neww), (top, left) = img.shape[:2], new, crop_at
    rows = axis(img, w, neww, left, S)  # [h, S, 3]
    return axis(rows.transpose(1, 0, 2), h, newh, top, S).transpose(1, 0, 2)


results = []
for name, shapes in json.loads(sys.argv[1]):
    config = SWIN_CONFIGS[name]
    images = []
    for n, shape in enumerate(shapes):
        if shape == "photos":  # every committed photo, as decoded (sizes differ)
            for path in sorted(PHOTOS.glob("*.jpg")):
                images.append(np.asarray(Image.open(path).convert("RGB")))
            continue
        h, w = shape
        g = np.random.default_rng(n)
        # smooth content with sharp edges: resampling rings past 0 and 255 on the edges
        base = g.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.NEAREST))
        images.append(np.ascontiguousarray(img))
    sizes = [(int(i.shape[0]), int(i.shape[1])) for i in images]
    values = torch.from_numpy(np.concatenate([i.reshape(-1, 3) for i in images]))
    out = preprocess_packed(values, sizes, config)
    mean = torch.tensor(config.mean).view(3, 1, 1)
    std = torch.tensor(config.std).view(3, 1, 1)
    S, R = config.img_size, config.resize_size
    pil_diff = own_diff = 0.0
    pil_off = []
    for k, img in enumerate(images):
        h, w = sizes[k]
        newh, neww = swin_tf.resize_shorter_side_size(h, w, R)
        top, left = swin_tf.center_crop_offsets(newh, neww, S)
        ref = Image.fromarray(img).resize((neww, newh), Image.Resampling.BICUBIC)
        crop = np.asarray(ref)[top : top + S, left : left + S]
        levels = ((out[k] * std + mean) * 255).permute(1, 2, 0).numpy()
        diff = np.abs(levels - crop)
        pil_diff = max(pil_diff, float(diff.max()))
        pil_off.append(float((diff > 0.5).mean()))
        own = two_pass(img, (newh, neww), (top, left), S)
        own_diff = max(own_diff, float(np.abs(levels - own).max()))
    tensor_path = swin_tf.preprocess_images([torch.from_numpy(i) for i in images], config, "cpu")
    results.append({
        "shape": list(out.shape),
        "pil_level_diff": pil_diff,
        "pil_levels_off": max(pil_off),
        "own_level_diff": own_diff,
        "tensor_path_diff": float((out - tensor_path).abs().max()),
        "finite": bool(torch.isfinite(out).all()),
    })
print(json.dumps(results))
"""

TINY = "swin_tiny_patch4_window7_224"
CASES = [
    # downscales, upscales, an unchanged axis, portrait and landscape
    (TINY, [(512, 683), (300, 400), (400, 260), (100, 150), (257, 256)]),
    (TINY, ["photos"]),  # the real photos at their decoded sizes, in one batch
    # another crop and resize size (64, 73); 584 -> 73 is an 8x reduction: 33 taps. Alone,
    # since a batch's horizontal pass runs over its tallest image's rows for every image
    # (the others' programs masked): with the three below, the interpreter took 29 s, 13 apart
    ("swin_test", [(584, 600)]),
    ("swin_test", [(64, 96), (40, 40), (200, 73)]),
]
# Pillow up to 12 always ran the horizontal pass first, as the kernels do; Pillow 13 runs
# the vertical one first when that costs less (tall images shrunk more in height). The
# order changes the intermediate rounding: on the synthetic edges above, by up to 13
# levels on 5% of pixels (Pillow 13.0). The committed photos are landscape: there, Pillow's exactly.
EXACTLY_PILLOW = [False, True, False, False]
PIL_MAJOR = int(PIL.__version__.split(".")[0])


def test_kernels_give_pillows_levels_exactly() -> None:
    results = run_interpreted(SCRIPT, CASES, timeout=600)
    for (name, _), exact, result in zip(CASES, EXACTLY_PILLOW, results, strict=True):
        S = SWIN_CONFIGS[name].img_size
        assert result["shape"][1:] == [3, S, S] and result["finite"], result
        # the kernels' levels are their arithmetic's exactly (the normalization's
        # rounding aside: a few ulps)
        assert result["own_level_diff"] < 1e-3, result
        if exact or PIL_MAJOR < 13:
            assert result["pil_level_diff"] < 1e-3, result
        # the float tensor path rounds differently at edges: a level or two
        assert result["tensor_path_diff"] < 0.05, result


def test_coefficients_resample_as_pillow_does() -> None:
    """One axis through the fixed-point weights equals Pillow's resize of a 1-pixel-high
    image, at every output position (a crop of them, as the kernels use)."""
    rng = np.random.default_rng(0)
    for in_size, out_size, start, count in [(683, 341, 58, 224), (100, 256, 16, 224),
                                            (2048, 256, 0, 256), (256, 256, 16, 224)]:  # fmt: skip
        row = rng.integers(0, 256, in_size, dtype=np.uint8)
        reference = np.asarray(
            Image.fromarray(row[None, :]).resize((out_size, 1), Image.Resampling.BICUBIC)
        )[0, start : start + count]
        first, taps, weights = pil_coefficients(in_size, out_size, start, count)
        assert (first >= 0).all() and (first + taps <= in_size).all()
        assert (weights.sum(axis=1) > 0).all()
        sums = np.full(count, 1 << (PRECISION_BITS - 1), dtype=np.int64)
        for t in range(weights.shape[1]):
            x = np.minimum(first + t, in_size - 1)
            sums += np.where(t < taps, row[x].astype(np.int64) * weights[:, t], 0)
        levels = np.clip(sums >> PRECISION_BITS, 0, 255)
        assert np.array_equal(levels, reference), (in_size, out_size)


STAGE_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from PIL import Image
from models.optimize import OptimizeOptions
from models.swin import SWIN_CONFIGS, load_swin
from server.engine.stages import ClassifyItem, SwinStage
from tests.conftest import PHOTOS

results = []
for name, buckets in json.loads(sys.argv[1]):
    config = SWIN_CONFIGS[name]
    stage = SwinStage(load_swin(config, None, seed=0), config, torch.device("cpu"),
                      OptimizeOptions(), buckets)
    paths = sorted(PHOTOS.glob("*.jpg"))
    photos = [np.asarray(Image.open(p).convert("RGB").reduce(3)) for p in paths]
    photos += [np.ascontiguousarray(p[::2, ::3]) for p in photos]  # other sizes, as many
    items = [ClassifyItem(p, 3) for p in photos]
    stage.packed = False  # the tensor path, image by image
    per_image = stage.logits([torch.from_numpy(p) for p in photos])
    top_tensor = stage.classify(items)
    stage.packed = True  # the kernels, in chunks of the largest bucket
    packed = stage.logits([torch.from_numpy(p) for p in photos])
    top_packed = stage.classify(items)
    results.append({
        "images": len(photos),
        "logit_diff": float((packed - per_image).abs().max()),
        "scale": float(per_image.abs().max()),
        "same_top1": [a.indices[0] == b.indices[0] for a, b in zip(top_tensor, top_packed)],
    })
print(json.dumps(results))
"""


def test_the_classifier_stage_serves_through_the_kernels() -> None:
    """`SwinStage` with the kernels (as on CUDA) gives the tensor path's logits, across
    chunks of its largest bucket and images of several sizes."""
    (result,) = run_interpreted(STAGE_SCRIPT, [("swin_test", [1, 2, 4])], timeout=600)
    assert result["images"] == 6
    assert result["logit_diff"] <= 0.05 * result["scale"], result
    assert all(result["same_top1"]), result


def test_the_intermediate_buffer_holds_each_images_rows_once() -> None:
    """The horizontal pass writes S pixels for each source row: the buffer the batch gets is
    sum(H) * S pixels of 3 bytes. (It was S times that: 6 GB for 32 photos, reserved for
    good by the caching allocator; H200, docs/BENCHMARKS.md.)"""
    from models.swin.resize_kernel import _tables

    config = SWIN_CONFIGS["swin_tiny_patch4_window7_224"]
    sizes = [(1365, 2048), (534, 800), (224, 224), (3000, 17)]
    params, _, _, inter_pixels, tallest = _tables(sizes, config)
    S = config.img_size
    assert inter_pixels == sum(h for h, _ in sizes) * S and tallest == 3000
    # each image's rows start where the previous image's end
    assert [int(p[3]) for p in params] == [0, 1365 * S, (1365 + 534) * S, (1365 + 534 + 224) * S]
