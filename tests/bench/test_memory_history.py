"""bench.memory_history: the segment mallocs of a recorded allocator history, summed by
stream and by the innermost frames of our code (the format torch.cuda.memory._dump_snapshot
writes; the CPU records none, so the snapshot is written out here)."""

from __future__ import annotations

from bench.memory_history import summarise


def frame(filename: str, line: int, name: str) -> dict[str, object]:
    return {"filename": filename, "line": line, "name": name}


def test_segment_mallocs_are_summed_by_stream_and_our_call_site() -> None:
    resize = [
        frame("/venv/torch/x.py", 1, "empty"),
        frame("/w/models/swin/resize_kernel.py", 223, "preprocess_packed"),
        frame("/w/server/engine/stages.py", 534, "logits"),
    ]
    runs = [frame("/w/server/engine/runs.py", 82, "mask_runs")]
    snapshot = {
        "device_traces": [[
            {"action": "segment_alloc", "size": 6_000_000_000, "stream": 0x10, "frames": resize},
            {"action": "segment_alloc", "size": 4_000_000_000, "stream": 0x10, "frames": resize},
            {"action": "alloc", "size": 512, "stream": 0x10, "frames": resize},
            {"action": "segment_alloc", "size": 2_000_000_000, "stream": 0x20, "frames": runs},
            {"action": "segment_free", "size": 2_000_000_000, "stream": 0x20, "frames": runs},
        ]],
        "segments": [{"stream": 0x10, "total_size": 10_000_000_000}],
    }  # fmt: skip
    text = summarise(snapshot, depth=2)
    assert "segments allocated: 12.00 GB in 3, freed: 2.00 GB" in text
    lines = [line for line in text.splitlines() if line.startswith("| 0x")]
    assert lines[0] == (
        "| 0x10 | 2 | 10.00 | 6000.0 | resize_kernel.py:223 preprocess_packed"
        " < stages.py:534 logits |"
    )
    assert lines[1] == "| 0x20 | 1 | 2.00 | 2000.0 | runs.py:82 mask_runs |"
    assert "reserved now by stream (GB): {'0x10': 10.0}" in text
