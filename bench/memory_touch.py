"""How fast this machine hands out memory never touched before, twice over.

Why: on the GPU machines lent to this project the first server started on a fresh machine
ran slower than later servers on the same machine, every hop of a request alike (issue
19, thirty-eighth and thirty-ninth sessions, docs/BENCHMARKS.md). One guess: the machines
are microVMs whose memory the host backs on first touch, so the first processes pay a
host page fault for every guest page they touch first, and later ones reuse pages the
host already backs. Then the first pass over `--gib` of fresh memory is much slower than
the second (the pages the first pass freed come back from the guest's free lists, still
backed); on a machine whose memory is backed from the start both passes run alike. Free
page reporting hands freed guest memory back to the host after a while, so a later run's
first pass may be slow again. This project's 2-core CPU machine is such a microVM, with
`page_reporting.page_reporting_order=11` on its kernel's command line (docs/BENCHMARKS.md
has its passes).

Each pass maps `--gib` of anonymous memory, writes one byte in every 4 KiB page (a page
fault each, the guest's zeroing of the page and, if the guess holds, the host's), and
unmaps it again.

    python3 -m bench.memory_touch --gib 64        # on a fresh GPU machine, before anything
"""

from __future__ import annotations

import argparse
import mmap
import time
from pathlib import Path

import numpy as np

PAGE = 4096
REPORTING = Path("/sys/module/page_reporting/parameters")


def touch(gib: float) -> float:
    """Seconds to map `gib` GiB and write one byte in each of its pages."""
    size = max(PAGE, int(gib * 2**30) // PAGE * PAGE)
    started = time.perf_counter()
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        pages = np.frombuffer(region, dtype=np.uint8)[::PAGE]
        pages[:] = 1
        del pages  # the view holds the buffer: close() refuses while it lives
        return time.perf_counter() - started
    finally:
        region.close()


def _reported_kib() -> int | None:
    """What free page reporting has handed back to the host since boot, where the kernel
    says (a counter of the microVMs' kernel, not of every kernel)."""
    try:
        return int((REPORTING / "reported_kib").read_text())
    except (OSError, ValueError):
        return None


def _setting(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=64.0, help="memory each pass touches")
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args(argv)
    print(f"transparent huge pages: {_setting('/sys/kernel/mm/transparent_hugepage/enabled')}")
    hypervisor = "hypervisor" in _setting("/proc/cpuinfo")
    print(f"under a hypervisor (cpuinfo flag): {hypervisor}")
    # free page reporting hands freed guest memory back to the host, which backs it again
    # at the next first touch: the kernel's command line and the module's settings say
    # whether it is on, and how much it has handed back so far
    reporting = [w for w in _setting("/proc/cmdline").split() if "page_reporting" in w]
    print(f"free page reporting: {' '.join(reporting) or 'not on the command line'}")
    params = sorted(REPORTING.glob("*")) if REPORTING.is_dir() else []
    print("page_reporting module:", " ".join(f"{f.name}={_setting(str(f))}" for f in params))
    print("| pass | GiB | seconds | GiB/s | us a 4 KiB page | MiB handed to the host meanwhile |")
    print("|---|---|---|---|---|---|")
    for n in range(1, args.passes + 1):
        before = _reported_kib()
        seconds = touch(args.gib)
        after = _reported_kib()
        pages = args.gib * 2**30 / PAGE
        handed = "-" if before is None or after is None else f"{(after - before) / 1024:.0f}"
        print(
            f"| {n} | {args.gib:g} | {seconds:.3f} | {args.gib / seconds:.2f} | "
            f"{seconds / pages * 1e6:.3f} | {handed} |"
        )


if __name__ == "__main__":
    main()
