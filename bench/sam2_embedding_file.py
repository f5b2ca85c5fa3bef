"""SAM 2's embedding download against a running service: can a decoder click on it?

For each photo: embed it (`POST /v1/embed`), download the `.npz` (`GET /v1/embeddings/{id}`,
timed), decode one multimask click from the file's three float16 arrays with an fp32 `Sam2`
on this machine's device (seeded random weights, or the checkpoint the server serves), and
compare its masks and scores with the served click on the same image_id: what a browser
decoder given the file would show against what the service answers.

    python -m bench.sam2_embedding_file --url http://127.0.0.1:8000 --images .benchdata/images

`--checkpoint` must name the server's weights (SERVE_SAM_CHECKPOINT); without it both use
seeded random weights (`--seed` as SERVE_SEED).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import DEFAULT_IMAGES, environment, print_table
from models.fidelity import mask_iou
from models.sam2 import SAM2_CONFIGS, Sam2Features, load_sam2
from models.sam2 import transforms as sam2_tf
from server.client import Client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    env = environment()
    print(env, flush=True)
    device = torch.device(args.device)
    rows = []
    with Client(args.url, timeout=300) as client:
        name = client.models()["models"][0]["name"]
        config = SAM2_CONFIGS[name]
        model = load_sam2(config, args.checkpoint, seed=args.seed).to(device).eval()
        for path in sorted(args.images.glob("*.jpg")):
            data = path.read_bytes()
            image_id = client.embed(data).image_id
            started = time.perf_counter()
            file = client.embedding(image_id)
            download_ms = (time.perf_counter() - started) * 1000
            h, w = file.original_size
            point = [[w * 0.5, h * 0.5]]
            served = client.click(image_id, point, [1], multimask=True)

            def tensor(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(a).to(device, torch.float32)

            features = Sam2Features(tensor(file.embedding), tuple(map(tensor, file.high_res)))
            with torch.inference_mode():
                pts = sam2_tf.scale_points(torch.tensor([point]), (h, w), config).to(device)
                pred = model.decode(features, pts, torch.tensor([[1]], device=device), None,
                                    None, True)  # fmt: skip
                masks, _ = sam2_tf.postprocess_masks(pred.low_res_masks, (h, w), config)
            order = pred.iou[0].argsort(descending=True, stable=True)
            mine = masks[0, order].cpu()
            theirs = torch.from_numpy(np.stack([m.mask for m in served.masks]))
            ious = mask_iou(mine, theirs).tolist()
            score_diff = np.abs(pred.iou[0, order].float().cpu().numpy()
                                - np.array([m.score for m in served.masks]))  # fmt: skip
            arrays = (file.embedding, *file.high_res)
            rows.append({
                "photo": path.name, "size": f"{w}x{h}",
                "arrays": " ".join("x".join(map(str, a.shape)) for a in arrays),
                "bytes": sum(a.nbytes for a in arrays), "download_ms": round(download_ms, 1),
                "iou_mean": round(statistics.mean(ious), 4), "iou_min": round(min(ious), 4),
                "score_diff_max": float(score_diff.max()),
            })  # fmt: skip
            print(rows[-1], flush=True)
    print(f"\n{name} served at {args.url}; decoded on {env['device'] or args.device}, "
          f"torch {env['torch']}, {env['date']}")  # fmt: skip
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
