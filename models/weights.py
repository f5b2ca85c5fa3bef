"""`python -m models.weights`: fetch the official checkpoints and check their SHA-256,
or make synthetic SAM weights where none can be fetched.

    python -m models.weights list
    python -m models.weights download vit_b --dest weights/
    python -m models.weights download swin_tiny_patch4_window7_224 --dest weights/
    python -m models.weights synthesize vit_b --dest weights/

A download streams into `<name>.part` while hashing, and becomes `<name>` only when its
size and SHA-256 match the published ones, so a broken transfer never leaves a file the
service would try to load. `--base-url` points at a mirror holding the same file names.

`synthesize` trains SAM's prompt encoder and mask decoder (image encoder frozen at its
seeded random weights) to draw the shapes that prompts name (models/sam/shapes.py) and
writes `sam_<model>_synthetic.pth` in Meta's format, with a sidecar `.json` that makes
the service report `"weights": "synthetic"`. A file already there with a matching sidecar
is kept (pass --force to train again). A SAM 2.1 name (`synthesize sam2.1_hiera_tiny`)
makes `<name>_synthetic.pt` the same way (`models/sam2/synthesize.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from models.provenance import sha256_file

__all__ = ["WEIGHTS", "WeightsError", "WeightsFile", "download", "sha256_file"]

log = logging.getLogger(__name__)
_CHUNK = 1 << 20


@dataclass(frozen=True)
class WeightsFile:
    """One published checkpoint: where it lives and what its bytes must hash to."""

    model: str  # the SERVE_SAM_MODEL / SERVE_SWIN_MODEL value it serves
    file_name: str
    url: str
    sha256: str | None  # None: not published; download needs --allow-unverified
    size: int | None = None


_SAM = "https://dl.fbaipublicfiles.com/segment_anything/"
_TIMM = "https://huggingface.co/timm/{}.ms_in1k/resolve/main/model.safetensors"

WEIGHTS: dict[str, WeightsFile] = {
    w.model: w
    for w in [
        WeightsFile(
            "vit_b", "sam_vit_b_01ec64.pth", _SAM + "sam_vit_b_01ec64.pth",
            "ec2df62732614e57411cdcf32a23ffdf28910380d03139ee0f4fcbe91eb8c912", 375_042_383,
        ),
        WeightsFile(
            "vit_l", "sam_vit_l_0b3195.pth", _SAM + "sam_vit_l_0b3195.pth",
            "3adcc4315b642a4d2101128f611684e8734c41232a17c648ed1693702a49a622", 1_249_524_607,
        ),
        WeightsFile(
            "vit_h", "sam_vit_h_4b8939.pth", _SAM + "sam_vit_h_4b8939.pth",
            "a7bf3b02f3ebf1267aba913ff637d9a2d5c33d3173bb679e46d9f338c26f262e",
        ),
        WeightsFile(
            "swin_tiny_patch4_window7_224", "swin_tiny_patch4_window7_224.safetensors",
            _TIMM.format("swin_tiny_patch4_window7_224"),
            "fb01861f793143135fa0d6cd97b1631e4b33eaa3ee162bbea9e62de1c76ebac1",
        ),
        WeightsFile(
            "swin_small_patch4_window7_224", "swin_small_patch4_window7_224.safetensors",
            _TIMM.format("swin_small_patch4_window7_224"), None,
        ),
        WeightsFile(
            "swin_base_patch4_window7_224", "swin_base_patch4_window7_224.safetensors",
            _TIMM.format("swin_base_patch4_window7_224"), None,
        ),
    ]
}  # fmt: skip


class WeightsError(RuntimeError):
    """A download that failed or whose bytes are not the published ones."""


def _check(path: Path, entry: WeightsFile, digest: str, size: int) -> None:
    if entry.size is not None and size != entry.size:
        raise WeightsError(f"{path}: {size} bytes, expected {entry.size} (truncated download?)")
    if entry.sha256 is not None and digest != entry.sha256:
        raise WeightsError(f"{path}: SHA-256 {digest}, expected {entry.sha256}")


def download(
    entry: WeightsFile,
    dest: Path,
    *,
    base_url: str | None = None,
    allow_unverified: bool = False,
    timeout_s: float = 60.0,
) -> Path:
    """Fetch `entry` into `dest` (skipped when a verified copy is already there)."""
    if entry.sha256 is None and not allow_unverified:
        raise WeightsError(
            f"no published SHA-256 for {entry.file_name}; pass --allow-unverified to fetch it "
            "anyway (its hash is printed so you can pin it)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / entry.file_name
    if target.exists() and entry.sha256 is not None:
        _check(target, entry, sha256_file(target), target.stat().st_size)
        log.info("%s is already here and verified", target)
        return target
    url = entry.url if base_url is None else base_url.rstrip("/") + "/" + entry.file_name
    partial = target.with_name(target.name + ".part")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, partial.open("wb") as out:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        _check(partial, entry, digest.hexdigest(), size)
    except (OSError, WeightsError) as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"downloading {url} failed: {exc}") from exc
    partial.replace(target)
    log.info("%s: %d bytes, SHA-256 %s", target, size, digest.hexdigest())
    return target


# Defaults of `synthesize`: (steps, batch size, crops). vit_tiny trains on the CPU in a
# couple of minutes; the released sizes are meant for a GPU (docs/ARCHITECTURE.md, Weights).
SYNTHESIZE_DEFAULTS = {"vit_tiny": (600, 16, 48), "sam2_test_tiny": (600, 16, 48)}
SYNTHESIZE_GPU_DEFAULTS = (6000, 32, 256)  # cut to --max-train-seconds (210 on CUDA)
DEFAULT_IMAGES = Path("../shared/data/images")


def add_synthesize_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    syn = sub.add_parser("synthesize", help="train synthetic SAM weights (shapes, not objects)")
    syn.add_argument(
        "model", help="a SAM size (vit_b, vit_l, vit_h, vit_tiny) or a SAM 2 one (sam2.1_hiera_*)"
    )
    syn.add_argument("--dest", type=Path, default=Path("weights"))
    syn.add_argument("--images", type=Path, default=DEFAULT_IMAGES, help="folder of photos")
    syn.add_argument("--steps", type=int, default=None, help="training steps")
    syn.add_argument("--batch-size", type=int, default=None, help="prompts per step")
    syn.add_argument("--crops", type=int, default=None, help="photo crops encoded for training")
    syn.add_argument("--lr", type=float, default=1e-3)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    syn.add_argument(
        "--max-train-seconds",
        type=float,
        default=None,
        help="fewer steps if the first ones show more would not fit (default: 210 on CUDA)",
    )
    syn.add_argument("--force", action="store_true", help="train even if the file is there")


def run_synthesize(args: argparse.Namespace) -> int:
    """The `synthesize` command: train, save, print the held-out measures."""
    import torch  # here, so that list and download start without torch

    from models.fidelity import load_photos
    from models.provenance import SYNTHETIC, read_provenance
    from models.sam import SAM_CONFIGS
    from models.sam.synthesize import SynthesisOptions, save_synthetic, synthesize
    from models.sam2 import SAM2_CONFIGS
    from models.sam2 import synthesize as sam2_synthesis

    sam2 = args.model in SAM2_CONFIGS
    if args.model not in SAM_CONFIGS and not sam2:
        names = sorted(SAM_CONFIGS) + sorted(SAM2_CONFIGS)
        print(f"error: unknown SAM model {args.model!r}; one of {names}", file=sys.stderr)
        return 2
    # SAM 2.1 files follow Meta's naming (`.pt`, `{"model": ...}` inside)
    target = args.dest / (
        f"{args.model}_synthetic.pt" if sam2 else f"sam_{args.model}_synthetic.pth"
    )
    if target.is_file() and not args.force:
        record = read_provenance(target)
        if (
            record is not None
            and record.get("weights") == SYNTHETIC
            and record.get("model") == args.model
        ):
            log.info("%s is already here (its sidecar matches); --force trains again", target)
            print(target)
            return 0
    steps, batch, crops = SYNTHESIZE_DEFAULTS.get(args.model, SYNTHESIZE_GPU_DEFAULTS)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    budget = args.max_train_seconds
    options = SynthesisOptions(
        steps=args.steps or steps,
        batch_size=args.batch_size or batch,
        crops=args.crops or crops,
        lr=args.lr,
        seed=args.seed,
        max_train_seconds=budget if budget or device.type != "cuda" else 210.0,
    )
    try:
        photos = load_photos(args.images)
    except (OSError, ValueError) as exc:
        print(f"error: {exc} (pass --images)", file=sys.stderr)
        return 2
    if sam2:
        model2, report = sam2_synthesis.synthesize(
            SAM2_CONFIGS[args.model], photos, options, device
        )
        path = sam2_synthesis.save_synthetic(model2, report, target)
    else:
        model, report = synthesize(SAM_CONFIGS[args.model], photos, options, device)
        path = save_synthetic(model, report, target)
    # every IoU against the size-1 shape; top=1x: how often the top-scored multimask output
    # is the size-1 one; IoU-head error: mean |score - actual IoU| over all 4 outputs
    print(
        f"{'kind':10} {'IoU':>7} {'min IoU':>8} {'multimask':>10} {'top=1x':>7}"
        f" {'IoU-head error':>15}"
    )
    for kind, iou in report.heldout_iou.items():
        print(
            f"{kind:10} {iou:7.4f} {report.heldout_iou_min[kind]:8.4f} "
            f"{report.multimask_best_iou[kind]:10.4f} {report.multimask_top_exact[kind]:7.2f} "
            f"{report.iou_head_error[kind]:15.4f}"
        )
    print(f"seconds: {report.seconds}")
    if min(report.heldout_iou.values()) < 0.9:
        log.warning("held-out IoU below 0.9 for some prompt kind: more --steps may help")
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the checkpoints this service can load")
    get = sub.add_parser("download", help="fetch and verify checkpoints")
    get.add_argument("models", nargs="+", choices=sorted(WEIGHTS))
    get.add_argument("--dest", type=Path, default=Path("weights"))
    get.add_argument("--base-url", default=None, help="a mirror with the same file names")
    get.add_argument("--allow-unverified", action="store_true")
    add_synthesize_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "synthesize":
        return run_synthesize(args)
    if args.command == "list":
        for w in WEIGHTS.values():
            print(f"{w.model:32} {w.file_name:44} {w.sha256 or '(no published SHA-256)'}")
        return 0
    try:
        for name in args.models:
            path = download(
                WEIGHTS[name],
                args.dest,
                base_url=args.base_url,
                allow_unverified=args.allow_unverified,
            )
            print(path)
    except WeightsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
