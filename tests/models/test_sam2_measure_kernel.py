"""SAM 2's fused segment-everything kernels (`models/sam2/measure_kernel.py`) against the
unfused path they replace: `F.interpolate` to the crop's size, then `stability_score` and
`masks_to_boxes`, and the generator's painting of the kept masks.

CI has no GPU, so the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py), where `runs_triton` also holds for CPU
tensors, so the generator takes its fused path there.
"""

from __future__ import annotations

from models.sam2.measure_kernel import _measure, _paint
from tests.models.interpreter import run_interpreted

KERNELS = r"""
import json, sys
import torch
import torch.nn.functional as F
from models.sam.automatic_ops import masks_to_boxes, stability_score
from models.sam2.measure_kernel import measure_upscaled, paint_upscaled

results = []
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    m, (h, w) = case["m"], case["size"]
    low = torch.randn(4, m, m) * 6.0
    low[1] = -5.0  # empty at every threshold: NaN stability, a (0, 0, 0, 0) box
    low[2] = 5.0  # everything: the whole crop
    low[3, 3:7, m // 2 : m // 2 + 5] += 40.0  # one strong blob
    low = low.to(getattr(torch, case["dtype"]))
    t, offset = case["threshold"], 1.0
    up = F.interpolate(low[:, None].float(), (h, w), mode="bilinear", align_corners=False)[:, 0]
    want = stability_score(up, t, offset)
    want_boxes = masks_to_boxes(up > t)
    stability, boxes = measure_upscaled(low, (h, w), t, offset)
    masks = torch.zeros(3, h + 5, w + 9, dtype=torch.bool)
    paint_upscaled(masks, low, torch.tensor([3, 0]), torch.tensor([0, 2]), (9, 5, 9 + w, 5 + h), t)
    want_masks = torch.zeros_like(masks)
    want_masks[0, 5:, 9:] = up[3] > t
    want_masks[2, 5:, 9:] = up[0] > t
    results.append({
        "stability_equal": bool(torch.equal(stability.nan_to_num(-1), want.nan_to_num(-1))),
        "boxes": boxes.tolist(),
        "want_boxes": want_boxes.tolist(),
        "masks_equal": bool(torch.equal(masks, want_masks)),
        "painted": int(masks.sum()),
    })
print(json.dumps(results))
"""


def test_measure_and_paint_equal_the_unfused_path() -> None:
    cases = [
        # down (the tiny model's 64 -> a crop smaller than it), up, non-square, bf16 logits
        {"seed": 0, "m": 64, "size": [40, 50], "dtype": "float32", "threshold": 0.0},
        {"seed": 1, "m": 32, "size": [97, 131], "dtype": "float32", "threshold": 0.0},
        {"seed": 2, "m": 32, "size": [70, 300], "dtype": "bfloat16", "threshold": 2.5},
    ]
    for case, result in zip(cases, run_interpreted(KERNELS, cases), strict=True):
        assert result["stability_equal"], case
        assert result["boxes"] == result["want_boxes"], case
        assert result["boxes"][1] == [0, 0, 0, 0]
        h, w = case["size"]
        assert result["boxes"][2] == [0, 0, w - 1, h - 1]
        assert result["masks_equal"], case
        assert result["painted"] > 0


GENERATOR = r"""
import json, sys
import numpy as np
import torch
from PIL import Image
import models.sam2.automatic as automatic
from models.sam2 import SAM2_CONFIGS, load_sam2
from models.sam2.automatic import Sam2AutomaticMaskGenerator, Sam2AutomaticMaskSettings
from tests.conftest import PHOTOS
from tests.models.sam2_blobs import blob_weights

torch.manual_seed(0)
model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None).eval()
blob_weights(model)  # blobs instead of noise
image = Image.open(PHOTOS / "dog.jpg").convert("RGB").resize((96, 64), Image.Resampling.BILINEAR)
photo = torch.from_numpy(np.array(image))
fused = automatic.runs_triton
FIELDS = ("masks", "scores", "stability", "boxes", "areas", "point_coords", "crop_boxes")
results = []
for case in json.loads(sys.argv[1]):
    settings = Sam2AutomaticMaskSettings(
        points_per_side=4, pred_iou_thresh=0.01, stability_score_thresh=0.6, **case
    )
    outputs = []
    for supported in (fused, lambda device: False):
        automatic.runs_triton = supported
        generator = Sam2AutomaticMaskGenerator(model, settings)
        outputs.append((generator._measures_every_candidate, generator.generate(photo)))
    (fast_all, a), (slow_all, b) = outputs
    results.append({
        "fused": fast_all and not slow_all,
        "masks": int(a.masks.shape[0]),
        "equal": all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS),
    })
print(json.dumps(results))
"""


def test_the_generator_gives_the_same_masks_with_the_fused_kernels() -> None:
    """One host sync per chunk instead of two, and no crop-size logits: the same result."""
    cases = [
        {"mask_threshold": 0.0},
        {"mask_threshold": 10.0, "crop_n_layers": 1, "crop_n_points_downscale_factor": 2},
    ]
    for case, result in zip(cases, run_interpreted(GENERATOR, cases), strict=True):
        assert result["fused"]
        assert result["masks"] >= 3, case  # enough masks for the comparison to mean something
        assert result["equal"], case


WARM = r"""
import json, sys
import torch
from models.sam2.measure_kernel import warm_kernels

done = []
for dtype in json.loads(sys.argv[1]):
    warm_kernels(16, getattr(torch, dtype), torch.device("cpu"))
    done.append(dtype)
print(json.dumps(done))
"""


def test_the_warm_up_runs_both_kernels_in_each_dtype() -> None:
    """`warm_kernels` (the service's warm-up, `Sam2Stages.warm_everything`) launches both
    kernels on fp32 and bf16 logits. On the GPU that is their one compile: they are not
    specialised on sizes."""
    assert run_interpreted(WARM, ["float32", "bfloat16"]) == ["float32", "bfloat16"]
    for kernel in (_measure, _paint):
        names = {n if isinstance(n, str) else kernel.arg_names[n] for n in kernel.do_not_specialize}
        assert {"m", "height", "width"} <= names
