"""Where an engine's GPU reserve came from: the segment allocations in a snapshot that
`SERVE_GPU_MEMORY_HISTORY` recorded and `kill -USR2` wrote (`server.engine.gpu_memory`).

Each `segment_alloc` event is a cudaMalloc the caching allocator made because no cached
block fitted; summed by the stream that asked and by the first frames of our own code in
its Python stack, they say which call grew the reserve, and by how much.

    python -m bench.memory_history /tmp/gpu-memory-1234-101500.pickle
"""

from __future__ import annotations

import argparse
import collections
import pickle
from pathlib import Path
from typing import Any

OURS = ("/server/", "/models/", "/bench/")


def _site(frames: list[dict[str, Any]], depth: int) -> str:
    """The innermost `depth` frames of our own code (else the innermost frames at all)."""
    ours = [f for f in frames if any(part in f.get("filename", "") for part in OURS)]
    chosen = (ours or frames)[:depth]
    return " < ".join(
        f"{Path(f.get('filename', '?')).name}:{f.get('line', '?')} {f.get('name', '?')}"
        for f in chosen
    )


def summarise(snapshot: dict[str, Any], depth: int = 3, rows: int = 25) -> str:
    """The report `main` prints for one snapshot (the dict `_dump_snapshot` pickles)."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    kinds = collections.Counter(e["action"] for e in events)
    lines = [f"{len(events)} events: {dict(kinds)}"]
    grown: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
    for event in events:
        if event["action"] == "segment_alloc":
            key = (int(event.get("stream", 0)), _site(event.get("frames", []), depth))
            grown[key].append(int(event["size"]))
    freed = sum(int(e["size"]) for e in events if e["action"] == "segment_free")
    ordered = sorted(grown.items(), key=lambda kv: -sum(kv[1]))
    total = sum(sum(sizes) for sizes in grown.values())
    lines.append(f"segments allocated: {total / 1e9:.2f} GB in "
                 f"{sum(map(len, grown.values()))}, freed: {freed / 1e9:.2f} GB")  # fmt: skip
    lines.append("| stream | segments | GB | largest MB | where (our innermost frames) |")
    lines.append("|---|---|---|---|---|")
    for (stream, site), sizes in ordered[:rows]:
        lines.append(f"| {stream:#x} | {len(sizes)} | {sum(sizes) / 1e9:.2f} | "
                     f"{max(sizes) / 1e6:.1f} | {site} |")  # fmt: skip
    by_stream: dict[int, int] = collections.Counter()
    for segment in snapshot.get("segments", []):
        by_stream[int(segment["stream"])] += int(segment["total_size"])
    reserved = {f"{k:#x}": round(v / 1e9, 2) for k, v in by_stream.items()}
    lines.append(f"reserved now by stream (GB): {reserved}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("snapshot", type=Path)
    p.add_argument("--depth", type=int, default=3, help="frames of our code per site")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    with args.snapshot.open("rb") as f:
        snapshot = pickle.load(f)
    print(summarise(snapshot, args.depth, args.rows))


if __name__ == "__main__":
    main()
