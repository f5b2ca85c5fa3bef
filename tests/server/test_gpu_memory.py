"""The allocator's segments summed by stream (`kill -USR2` an engine on CUDA): the sums,
the names, and the largest free block, on segments in torch.cuda.memory_snapshot()'s
format (the CPU has no allocator to snapshot)."""

from __future__ import annotations

from typing import Any

from server.engine.gpu_memory import summarize_segments

MB = 1_000_000


def segment(stream: int, total: int, blocks: list[tuple[int, str]], pool=(0, 0)) -> dict[str, Any]:
    return {
        "stream": stream,
        "total_size": total,
        "allocated_size": sum(size for size, state in blocks if state == "active_allocated"),
        "segment_pool_id": pool,
        "blocks": [{"size": size, "state": state} for size, state in blocks],
    }


def test_segments_are_summed_per_stream_and_pool_largest_first() -> None:
    decoder = 0x7F00
    segments = [
        segment(0, 20 * MB, [(8 * MB, "active_allocated"), (12 * MB, "inactive")]),
        segment(decoder, 100 * MB, [(100 * MB, "inactive")]),
        segment(decoder, 40 * MB, [(30 * MB, "active_allocated"), (10 * MB, "inactive")]),
        segment(decoder, 50 * MB, [(50 * MB, "active_allocated")], pool=(1, 3)),
        segment(0xBEEF, 2 * MB, [(2 * MB, "active_pending_free")]),
    ]
    rows = summarize_segments(segments, {decoder: "sam_decoder"})
    assert [r["pool"] for r in rows] == [
        "sam_decoder", "sam_decoder, pool 1.3", "default", "0xbeef"
    ]  # fmt: skip
    decoder_row = rows[0]
    assert decoder_row == {
        "pool": "sam_decoder",
        "segments": 2,
        "reserved_mb": 140.0,
        "allocated_mb": 30.0,
        "free_blocks": 2,
        "largest_free_mb": 100.0,
        "largest_segment_mb": 100.0,
    }
    assert rows[2]["reserved_mb"] == 20.0 and rows[2]["largest_free_mb"] == 12.0
    assert rows[3]["free_blocks"] == 0  # pending free is not free yet


def test_no_segments_no_rows() -> None:
    assert summarize_segments([], {}) == []
