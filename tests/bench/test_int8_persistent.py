"""bench/int8_persistent.py's products: SAM ViT-B's and Swin-T's, with their epilogues."""

from __future__ import annotations

from bench.int8_persistent import sam_products, swin_products


def test_sam_products_are_a_vit_b_block_per_kind_with_tanh_rows_for_gelu() -> None:
    rows = sam_products(8, {"window": 25 * 196, "global": 4096})
    layers = [r["layer"] for r in rows]
    assert layers == [f"{k}.{n}" for k in ("window", "global")
                      for n in ("qkv", "proj", "lin1", "lin1~tanh", "lin2")]  # fmt: skip
    lin2 = rows[4]
    assert (lin2["M"], lin2["K"], lin2["N"], lin2["residual"]) == (39200, 3072, 768, True)
    tanh = rows[3]
    assert tanh["gelu"] and tanh["tanh"] and not rows[2]["tanh"]


def test_swin_products_cover_four_stages_and_none_at_batch_zero() -> None:
    assert swin_products(0) == []
    rows = swin_products(256)
    assert len(rows) == 16
    assert rows[0]["M"] == 256 * 3136 and rows[0]["K"] == 96 and rows[0]["N"] == 288
    assert all(r["tanh"] == r["gelu"] for r in rows)
    assert sum(r["layer"].endswith("~tanh") for r in rows) == 4
