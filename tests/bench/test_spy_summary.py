"""bench.spy_summary: py-spy's collapsed stacks summed up per thread, inclusive and leaf."""

from __future__ import annotations

from bench.spy_summary import summarise

# py-spy `record --threads -f raw` lines: the thread first, then the frames, root first
RAW = [
    "thread (0x7F01);run (threading.py:1010);decode (server/engine/stages.py:240);"
    "pack (models/sam/prompts.py:80) 6",
    'thread (0x7F01);run (threading.py:1010);decode (server/engine/stages.py:251) 3',
    'thread (0x7F02);select (selectors.py:468) 11',
    "garbage line without a count",
]  # fmt: skip


def test_each_thread_gets_its_samples_functions_and_leaves():
    text = summarise(RAW, top=10)
    blocks = {b.splitlines()[0]: b for b in text.split("== ")[1:]}
    loop = blocks["thread (0x7F02): 11 samples"]
    assert "11 100.0%  select (selectors.py)" in loop
    worker = blocks["thread (0x7F01): 9 samples"]
    inclusive, leaf = worker.split("  leaf:")
    # a function counts once per stack, whichever of its lines the samples were on
    assert "9 100.0%  decode (server/engine/stages.py)" in inclusive
    assert "6  66.7%  pack (models/sam/prompts.py)" in inclusive
    assert "6  66.7%  pack (models/sam/prompts.py)" in leaf
    assert "3  33.3%  decode (server/engine/stages.py)" in leaf
    # the busiest thread first
    assert text.index("0x7F02") < text.index("0x7F01")
