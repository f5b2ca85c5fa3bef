"""A py-spy raw profile (`py-spy record -f raw`, collapsed stacks) summed up per thread.

For each thread that was sampled: its samples, the functions it spent them in counted
inclusively (each function once per stack: where a thread's time goes, top down) and its
leaf frames (where the time is spent itself). Threads are told apart by the first frame
py-spy writes with `--threads`; without it every stack is one "all threads" group.

    python -m bench.spy_summary /tmp/spy.raw [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def _function(frame: str) -> str:
    """`name (file.py:line)` -> `name (file.py)`: one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def summarise(lines: list[str], top: int) -> str:
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames[:2] if f.startswith("thread")), "all threads")
        body = [f for f in frames if not f.startswith(("thread", "process"))]
        n = int(count)
        totals[thread] += n
        for function in {_function(f) for f in body}:
            threads[thread][function] += n
        if body:
            leaves[thread][_function(body[-1])] += n
    out: list[str] = []
    for thread, total in totals.most_common():
        out.append(f"== {thread}: {total} samples")
        out.append("  inclusive:")
        for function, n in threads[thread].most_common(top):
            out.append(f"    {n:7d} {100 * n / total:5.1f}%  {function}")
        out.append("  leaf:")
        for function, n in leaves[thread].most_common(max(top // 2, 5)):
            out.append(f"    {n:7d} {100 * n / total:5.1f}%  {function}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    sys.stdout.write(summarise(args.raw.read_text().splitlines(), args.top) + "\n")


if __name__ == "__main__":
    main()
