"""COCO runs made straight from low-res logits (`models/sam/runs_kernel.py`, through
`server.engine.runs.low_res_runs`) against the path they replace: the masks upscaled by
`F.interpolate`, thresholded, and their runs found by `mask_runs`. Then the stages: a
decoder batch through SAM's and SAM 2's `decode` with the kernel and without it.

CI has no GPU, so the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, in a
subprocess: tests/models/interpreter.py): the same kernel source, on the CPU, where its
float32 arithmetic and torch's CPU interpolation agree bit for bit on these seeds. On a GPU
the two round the odd logit within float32 rounding of the threshold either way
(`bench/gpu_click_runs.sh` counts such pixels).
"""

from __future__ import annotations

from tests.models.interpreter import run_interpreted

SCRIPT = r"""
import json, sys
import numpy as np
import torch
from bench.runs_check import full_size_runs
from models.sam.runs_kernel import RunsGroup
from server.engine.runs import RunsCapacity, low_res_runs
from server.rle import counts_string

def same(a, b):
    return all(
        x.size == y.size
        and len(x.counts) == len(y.counts)
        and all(np.array_equal(p, q) for p, q in zip(x.counts, y.counts, strict=True))
        and np.array_equal(x.areas, y.areas) and np.array_equal(x.boxes, y.boxes)
        for x, y in zip(a, b, strict=True)
    )

results = []
for seed, square, m, shift, threshold, groups in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(seed)
    prompts = 1 + max(r for group in groups for r in group[0])
    low = torch.randn(prompts, 4, m, m, generator=g) * 3 + shift
    # a strided view, as a decoder's padded graph outputs are
    low = torch.cat([low, low], dim=1)[:, :4]
    iou = torch.rand(prompts, 4, generator=g)
    order = iou[:, 1:].sort(dim=1, descending=True, stable=True).indices
    made = [RunsGroup(rows, multi, tuple(inp), tuple(size)) for rows, multi, inp, size in groups]
    got = low_res_runs(low, order, made, threshold, square)
    # one copy back with room fixed in advance: too little (a second copy), then learnt
    # from that batch, then room for every pixel
    tight = RunsCapacity(floor=1)
    roomy = RunsCapacity(floor=10**6)
    one_copy = {
        "tight": same(low_res_runs(low, order, made, threshold, square, tight), got),
        "learnt": same(low_res_runs(low, order, made, threshold, square, tight), got),
        "roomy": same(low_res_runs(low, order, made, threshold, square, roomy), got),
        "overflows": [tight.overflows, roomy.overflows],
    }
    # the same masks as COCO strings written by the device (models.sam.coco_kernel): with
    # the run starts counted first, with too little room for them, and with no room for
    # the characters in the first copy (all of them in a second)
    want = [counts_string(c) for runs in got for c in runs.counts]

    class NoChars(RunsCapacity):
        def chars(self, runs):
            return 0

    def strings(capacity):
        made_strings = low_res_runs(low, order, made, threshold, square, capacity, strings=True)
        return (
            [s for runs in made_strings for s in runs.strings] == want
            and all(runs.counts is None for runs in made_strings)
            and all(np.array_equal(x.areas, y.areas) and np.array_equal(x.boxes, y.boxes)
                    for x, y in zip(got, made_strings, strict=True))
        )

    no_chars = NoChars()
    one_copy["strings"] = [strings(None), strings(RunsCapacity(floor=1)), strings(no_chars)]
    one_copy["chars_overflows"] = no_chars.chars_overflows
    case = [one_copy]
    for group, runs in zip(made, got):
        (want,) = full_size_runs(low, order, group, square, threshold)
        case.append({
            "size": list(runs.size) == list(group.size),
            "masks": [len(runs), len(want)],
            "counts": all(
                np.array_equal(a, b) for a, b in zip(runs.counts, want.counts, strict=True)
            ),
            "starts_with_zero_run": all(int(c[0]) >= 0 for c in runs.counts),
            "areas": runs.areas.tolist(), "want_areas": want.areas.tolist(),
            "boxes": runs.boxes.tolist(), "want_boxes": want.boxes.tolist(),
            "sums": [int(c.sum()) for c in runs.counts],
        })
    results.append(case)
print(json.dumps(results))
"""

# (seed, square or None for SAM 2, low-res side, logit shift, threshold, groups), a group
# being (prompt rows, multimask, input size, image size)
CASES = [
    # SAM: three image sizes in one batch, multimask and single, rows out of order
    (0, 128, 32, 0.0, 0.0, [
        ([2, 0], True, [128, 96], [50, 37]),
        ([1], False, [96, 128], [41, 60]),
        ([3, 4], True, [128, 128], [7, 5]),
    ]),
    # SAM 2 (one resize), a 1-pixel-tall and a 1-pixel-wide image, another threshold
    (1, None, 16, 0.0, 0.5, [
        ([0], True, [16, 16], [1, 40]),
        ([1, 2], False, [16, 16], [33, 1]),
        ([3], True, [16, 16], [64, 48]),
    ]),
    # masks wholly empty and wholly set: areas 0 with zero boxes, and one full run
    (2, 128, 32, -50.0, 0.0, [([0], True, [128, 128], [20, 30])]),
    (3, 128, 32, 50.0, 0.0, [([0, 1], False, [128, 80], [24, 15])]),
]  # fmt: skip


def test_runs_from_low_res_logits_are_the_upscaled_masks_runs() -> None:
    results = run_interpreted(SCRIPT, CASES)
    for (_, _, _, shift, _, groups), (one_copy, *case) in zip(CASES, results, strict=True):
        # room for one run a mask overflows once where masks have more (learnt after it);
        # wholly empty or wholly set masks have one each
        overflows = [0 if shift else 1, 0]
        assert one_copy == {
            "tight": True, "learnt": True, "roomy": True, "overflows": overflows,
            "strings": [True, True, True], "chars_overflows": 1,
        }  # fmt: skip
        for (rows, multimask, _, (h, w)), got in zip(groups, case, strict=True):
            k = 3 if multimask else 1
            assert got["size"] and got["masks"] == [len(rows) * k] * 2
            assert got["counts"], got
            assert got["areas"] == got["want_areas"] and got["boxes"] == got["want_boxes"]
            assert got["sums"] == [h * w] * (len(rows) * k)  # the runs cover every pixel
            if shift < 0:
                assert got["areas"] == [0] * k and got["boxes"] == [[0.0] * 4] * k
            if shift > 0:
                assert got["areas"] == [h * w] * len(rows)
                assert got["boxes"] == [[0.0, 0.0, float(w), float(h)]] * len(rows)


STAGES = r"""
import json, sys
import numpy as np
import torch
from models.optimize import OptimizeOptions
from models.sam import SAM_CONFIGS, load_sam
from models.sam2 import SAM2_CONFIGS, load_sam2
from server.domain import Prompt
from server.engine.sam2_stages import Sam2Stages
from server.engine.stages import DecodeItem, EncodeItem, SamStages
from server.rle import counts_string

cpu = torch.device("cpu")
results = []
for name in json.loads(sys.argv[1]):
    if name == "sam":
        config = SAM_CONFIGS["vit_tiny"]
        model = load_sam(config, None, seed=0)
        stages = SamStages(model, config, cpu, OptimizeOptions(), [1], [1, 8], rle_on_device=True)
    else:
        model = load_sam2(SAM2_CONFIGS["sam2_test_tiny"], None, seed=0)
        stages = Sam2Stages(model, cpu, OptimizeOptions(), [1], [1, 8], rle_on_device=True)
    rng = np.random.default_rng(0)
    sizes = [(40, 56), (33, 21)]
    photos = [torch.from_numpy(rng.integers(0, 256, (*size, 3), np.uint8)) for size in sizes]
    a, b = (stages.encode([EncodeItem(f"img{n}", p)])[0] for n, p in enumerate(photos))
    click = (Prompt(points=((20.0, 15.0),), labels=(1,)),)
    boxes = (
        Prompt(box=(2.0, 3.0, 30.0, 25.0)),
        Prompt(points=((5.0, 5.0), (9.0, 30.0)), labels=(1, 0)),
    )
    items = [
        DecodeItem(a, click, multimask=True, return_low_res=True),
        DecodeItem(b, boxes, multimask=False),
        DecodeItem(a, boxes, multimask=True, output="png"),
        DecodeItem(a, click, multimask=False, return_low_res=True),
        DecodeItem(b, click, multimask=True),
    ]
    assert stages.fused_runs and not stages.device_strings
    fused = stages.decode(items)
    stages.device_strings = True
    written = stages.decode(items)
    stages.device_strings = False
    stages.fused_runs = False
    plain = stages.decode(items)
    same = []
    for want, got, text in zip(plain, fused, written, strict=True):
        for x, y, z in zip(want, got, text, strict=True):
            same.append({
                "strings": (x.runs is None) == (z.runs is None) and (x.runs is None or (
                    z.runs.counts is None
                    and [z.runs.string(k) for k in range(len(z.runs))]
                    == [counts_string(c) for c in x.runs.counts]
                    and np.array_equal(x.runs.areas, z.runs.areas))),
                "runs": (x.runs is None) == (y.runs is None) and (x.runs is None or (
                    x.runs.size == y.runs.size
                    and all(np.array_equal(p, q) for p, q in zip(x.runs.counts, y.runs.counts))
                    and np.array_equal(x.runs.areas, y.runs.areas)
                    and np.array_equal(x.runs.boxes, y.runs.boxes))),
                "masks": (x.masks is None and y.masks is None) or np.array_equal(x.masks, y.masks),
                "scores": np.array_equal(x.scores, y.scores),
                "low_res": x.low_res is None and y.low_res is None
                or torch.equal(x.low_res, y.low_res),
                "has_runs": y.runs is not None,
                "masks_runs": len(y.runs) if y.runs is not None else 0,
            })
    results.append(same)
print(json.dumps(results))
"""


def test_stages_decode_the_same_masks_with_the_kernel_and_without() -> None:
    """A batch of several images, multimask and single, refinement handles and a png
    item beside RLE ones: the same runs, scores, kept low-res logits and png masks."""
    results = run_interpreted(STAGES, ["sam", "sam2"], timeout=600)
    for same in results:
        assert len(same) == 1 + 2 + 2 + 1 + 1
        for prompt in same:
            assert prompt["runs"] and prompt["masks"] and prompt["scores"] and prompt["low_res"]
            assert prompt["strings"]
        # the png item's masks came through the host; every other item's runs through the kernel
        assert [p["has_runs"] for p in same] == [True, True, True, False, False, True, True]
        assert [p["masks_runs"] for p in same] == [3, 1, 1, 0, 0, 1, 3]
