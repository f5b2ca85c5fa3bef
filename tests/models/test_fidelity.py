"""models.fidelity: the measures, the prompts and views, the photo loader and the command
(models.fidelity_cli),
on real photos (made small, so the tiny models run them in a second on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from models.fidelity import (
    FidelityPrompt,
    compare_sam,
    compare_swin,
    eager_sam_runner,
    eager_swin_runner,
    fidelity_prompts,
    load_photos,
    mask_iou,
    swin_views,
)
from models.fidelity_cli import main
from models.optimize import OptimizeOptions, prepare_sam_encoder, prepare_swin
from models.sam import SAM_CONFIGS, load_sam
from models.swin import SWIN_CONFIGS, load_swin

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def photos(small_photo_dir: Path) -> list[torch.Tensor]:
    return load_photos(small_photo_dir)


def test_load_photos_reads_jpeg_and_png_upright_and_limits(small_photo_dir: Path, tmp_path: Path):
    photos = load_photos(small_photo_dir)
    assert len(photos) == 3 and all(p.dtype == torch.uint8 and p.shape[2] == 3 for p in photos)
    assert len(load_photos(small_photo_dir, limit=2)) == 2
    # EXIF orientation 6 (rotate 90 degrees): the photo as a viewer shows it
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (40, 20), (200, 30, 30)).save(tmp_path / "rotated.jpg", exif=exif)
    (rotated,) = load_photos(tmp_path)
    assert tuple(rotated.shape) == (40, 20, 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no \.jpg or \.png"):
        load_photos(empty)


def test_mask_iou_counts_two_empty_masks_as_equal() -> None:
    a = torch.zeros(3, 4, 4, dtype=torch.bool)
    b = a.clone()
    a[1, :2] = True  # 8 pixels
    b[1, :1] = True  # 4 of them
    a[2, 0, 0] = True  # disjoint from b
    assert mask_iou(a, b).tolist() == [1.0, 0.5, 0.0]


def test_prompts_lie_inside_the_photo_and_cover_the_forms() -> None:
    prompts = fidelity_prompts(120, 300)
    assert len(prompts) == 5
    assert {(bool(p.points), p.box is not None) for p in prompts} == {
        (False, True), (True, False), (True, True)
    }  # fmt: skip
    assert any(0 in p.labels for p in prompts), "a background point"
    for p in prompts:
        assert len(p.points) == len(p.labels)
        for x, y in [*p.points, *([p.box[:2], p.box[2:]] if p.box else [])]:
            assert 0 <= x <= 300 and 0 <= y <= 120


def test_sam_against_itself_is_exact_and_a_quantized_encoder_is_not(photos) -> None:
    config = SAM_CONFIGS["vit_tiny"]
    reference = eager_sam_runner(load_sam(config, None, seed=3), CPU)
    same = compare_sam(reference, eager_sam_runner(load_sam(config, None, seed=3), CPU), photos)
    assert (same.photos, same.masks) == (3, 3 * 5 * 4)
    assert same.embedding_rel_error == 0 and same.score_diff_max == 0
    assert same.mask_iou_min == same.mask_iou_mean == 1
    assert same.shortfalls(min_mask_iou=1.0, max_embedding_error=0.0) == []

    int8 = load_sam(config, None, seed=3)
    prepare_sam_encoder(int8.image_encoder, OptimizeOptions(quantization="int8"), CPU)
    result = compare_sam(reference, eager_sam_runner(int8, CPU), photos)
    assert 0 < result.embedding_rel_error < 0.1
    assert 0.5 < result.mask_iou_min <= result.mask_iou_mean <= 1
    assert result.score_diff_max > 0
    missed = result.shortfalls(min_mask_iou=1.0, max_embedding_error=1e-9)
    assert len(missed) == 2 and "mask IoU" in missed[0] and "embedding error" in missed[1]
    assert result.shortfalls(min_mask_iou=0.0, max_embedding_error=1.0) == []


def test_sam_outputs_are_every_mask_at_the_photo_size(photos) -> None:
    run = eager_sam_runner(load_sam(SAM_CONFIGS["vit_tiny"], None, seed=0), CPU)
    h, w = photos[0].shape[:2]
    out = run(photos[0], [FidelityPrompt(box=(1.0, 2.0, w / 2, h / 2))])
    assert out.masks.dtype == torch.bool and tuple(out.masks.shape) == (1, 4, h, w)
    assert tuple(out.scores.shape) == (1, 4) and out.embedding.ndim == 3


def test_swin_views_are_seeded_crops_and_flips(photos) -> None:
    views = swin_views(photos, 10)
    again = swin_views(photos, 10)
    assert len(views) == 10 and all(torch.equal(a, b) for a, b in zip(views, again, strict=True))
    for k, view in enumerate(views):
        h, w = photos[k % 3].shape[:2]
        assert 0.39 * h <= view.shape[0] <= h and 0.39 * w <= view.shape[1] <= w
    assert not all(
        torch.equal(a, b) for a, b in zip(views, swin_views(photos, 10, seed=1), strict=True)
    )


def test_swin_against_itself_agrees_fully_and_bf16_moves_the_logits(photos) -> None:
    config = SWIN_CONFIGS["swin_test"]
    views = swin_views(photos, 24)
    reference = eager_swin_runner(load_swin(config, None, seed=2), config, CPU, batch=8)
    twin = eager_swin_runner(load_swin(config, None, seed=2), config, CPU, batch=5)
    same = compare_swin(reference, twin, views)
    assert (same.views, same.top1_agreement) == (24, 1.0)
    assert same.logit_max_abs_error < 1e-5  # batches of 8 and of 5 round differently
    half = load_swin(config, None, seed=2).to(torch.bfloat16)
    prepare_swin(half, OptimizeOptions(precision="bf16"))
    result = compare_swin(reference, eager_swin_runner(half, config, CPU), views)
    assert 0 < result.logit_rel_error < 0.05 and result.logit_max_abs_error > 0
    assert result.shortfalls(min_top1_agreement=0.0) == []
    if result.top1_agreement < 1:
        assert "top-1 agreement" in result.shortfalls(min_top1_agreement=1.0)[0]


def test_the_command_prints_one_table_per_model(small_photo_dir: Path, capsys) -> None:
    code = main(["--images", str(small_photo_dir), "--sam-model", "vit_tiny", "--swin-model",
                 "swin_test", "--variants", "fp32", "fp32-int8", "--swin-views", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    tables = [block for block in out.split("\n| model ") if "---" in block]
    assert len(tables) == 2, out
    rows = [line for line in out.splitlines() if line.startswith("| sam_vit_tiny")]
    assert [row.split(" | ")[1] for row in rows] == ["fp32", "fp32-int8"]
    fp32 = rows[0].split(" | ")
    assert fp32[3:5] == ["60", "0.0000"] and fp32[5] == "1.0000"  # masks, error, mean IoU
    assert sum(line.startswith("| swin_test") for line in out.splitlines()) == 2


def test_the_command_refuses_an_unknown_variant(small_photo_dir: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--images", str(small_photo_dir), "--variants", "bf8"])
    assert exit_info.value.code == 2


def test_the_command_measures_sam2_precisions_and_points_elsewhere_for_int8(
    small_photo_dir: Path, capsys
) -> None:
    """SAM 2 through the same table: fp32 against itself is exact, bf16 is not; its
    int8 is refused with the bench that measures it."""
    code = main(["--images", str(small_photo_dir), "--sam-model", "sam2_test_tiny",
                 "--swin-model", "none", "--variants", "fp32", "bf16"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| sam2_test_tiny")]
    assert [row[1] for row in rows] == ["fp32", "bf16"]
    assert rows[0][3:6] == ["60", "0.0000", "1.0000"]  # masks, embedding error, mean IoU
    assert float(rows[1][4]) > 0
    with pytest.raises(SystemExit) as exit_info:
        main(["--images", str(small_photo_dir), "--sam-model", "sam2_test_tiny",
              "--swin-model", "none", "--variants", "bf16-int8"])  # fmt: skip
    assert exit_info.value.code == 2
    assert "bench.sam2_quant" in capsys.readouterr().err


def test_python_m_models_fidelity_runs_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "models.fidelity", "--help"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "sam2.1_hiera_large" in done.stdout, done.stderr
