"""Open-loop load on the service: Poisson arrivals at fixed rates, latency from each
request's scheduled time, one row per (step, kind). See bench/openloop/__init__.py.

    python -m bench.openloop --kind segment --rates 50,100,200,300 --seconds 15
    python -m bench.openloop --mix segment=150,click=1000,classify=500 --processes 8
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.openloop import report
from bench.openloop.kinds import KINDS, Photo, click_copy
from bench.openloop.worker import StepSpec, run_step
from bench.service_load import DEFAULT_IMAGES, load_images
from server.client import Client, ServiceError

log = logging.getLogger("bench.openloop")

Step = tuple[str, tuple[tuple[str, float], ...]]  # (label, ((kind, req/s), ...))


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers with commas, not {text!r}") from None
    if not rates or any(not math.isfinite(r) or r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, not {text!r}")
    return rates


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """'segment=150,click=1000' -> (("segment", 150.0), ("click", 1000.0))."""
    out: dict[str, float] = {}
    for part in text.split(","):
        kind, _, rate = part.partition("=")
        kind = kind.strip()
        if kind not in KINDS or kind in out:
            raise argparse.ArgumentTypeError(f"{part!r}: kinds are {', '.join(KINDS)}, once each")
        out[kind] = parse_rates(rate)[0]
    return tuple(out.items())


def build_steps(kind: str | None, rates: list[float] | None, mixes: list[Any]) -> list[Step]:
    if mixes:
        many = len(mixes) > 1
        return [(f"mix{n + 1}" if many else "mix", mix) for n, mix in enumerate(mixes)]
    if kind is None or rates is None:
        raise ValueError("give --kind with --rates, or --mix")
    return [(f"{kind}@{rate:g}", ((kind, rate),)) for rate in rates]


def embed_photos(
    url: str, images: tuple[Photo, ...], api_key: str | None, count: int | None = None
) -> tuple[str, ...]:
    """Encode each click image once, before any click is timed (the annotation tool's first
    call): `count` images, image i a copy of photo `i % len(images)` (`click_copy`); by
    default the photos themselves."""
    count = len(images) if count is None else count
    try:
        with Client(url, api_key=api_key, timeout=120) as client:
            return tuple(
                client.embed(click_copy(images[i % len(images)][1], i // len(images))).image_id
                for i in range(count)
            )
    except (ServiceError, httpx.HTTPError) as exc:
        raise SystemExit(f"embedding the photos for the clicks failed: {exc!r}") from None


def served_models(url: str, api_key: str | None) -> Any:
    """What answered (GET /v1/models), so a row of figures names its model and device."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        return r.json() if r.status_code == 200 else {"status": r.status_code}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": repr(exc)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.openloop",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--kind", choices=KINDS, help="one kind at each of --rates")
    p.add_argument("--rates", type=parse_rates, help="req/s, with commas: 50,100,200")
    mix_help = "kinds at once, e.g. segment=150,click=1000,classify=500 (repeatable)"
    p.add_argument("--mix", type=parse_mix, action="append", default=[], help=mix_help)
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per step")
    p.add_argument("--warmup-seconds", type=float, default=2.0, help="sent, not counted")
    p.add_argument("--pause-seconds", type=float, default=1.0, help="quiet between steps")
    p.add_argument("--timeout", type=float, default=10.0, help="per request, in seconds")
    p.add_argument("--processes", type=int, default=4, help="client processes")
    pool_help = "connection pool: rate x this many seconds of requests in flight"
    p.add_argument("--inflight-seconds", type=float, default=2.0, help=pool_help)
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES, help="folder of .jpg photos")
    click_help = (
        "images the clicks spread over: copies of the photos with new bytes, so new image_ids "
        "(default: the photos). Engines are chosen by image_id: a few photos load a few "
        "engines, where many annotators each on an image of their own load all alike"
    )
    p.add_argument("--click-images", type=int, default=None, help=click_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client", choices=("wire", "httpx"), default="wire",
        help="HTTP client: wire (bench/openloop/wire.py, lean) or httpx (to compare)",
    )  # fmt: skip
    p.add_argument(
        "--spin-ms", type=float, default=1.0,
        help="busy-wait this long before each arrival, so requests leave on time, in a "
        "process whose rate is at most 200/s (0: sleep only; asyncio then sends up to ~1 ms late)",
    )  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.mix and (args.kind or args.rates):
        p.error("--mix runs instead of --kind/--rates: give one or the other")
    if not args.mix and not (args.kind and args.rates):
        p.error("give --kind with --rates, or --mix")
    if args.processes < 1 or args.seconds <= 0 or args.warmup_seconds < 0 or args.timeout <= 0:
        p.error("--processes >= 1, --seconds > 0, --warmup-seconds >= 0, --timeout > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    steps = build_steps(args.kind, args.rates, args.mix)
    url = args.url.rstrip("/")
    images = load_images(args.images)
    clicks = any(kind == "click" for _, rates in steps for kind, _ in rates)
    if args.click_images is not None and args.click_images < len(images):
        p.error(f"--click-images: at least one per photo ({len(images)} in {args.images})")
    image_ids = embed_photos(url, images, args.api_key, args.click_images) if clicks else ()
    base = StepSpec(
        url=url, rates=(), seconds=args.seconds, warmup_s=args.warmup_seconds,
        timeout_s=args.timeout, processes=args.processes, seed=args.seed,
        nonce=os.urandom(8).hex(), images=images, image_ids=image_ids, api_key=args.api_key,
        inflight_s=args.inflight_seconds, client=args.client, spin_s=args.spin_ms / 1000,
    )  # fmt: skip
    run = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": ["python -m bench.openloop", *(sys.argv[1:] if argv is None else argv)],
        "url": url,
        "processes": args.processes,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "timeout_s": args.timeout,
        "inflight_seconds": args.inflight_seconds,
        "client": args.client,
        "spin_ms": args.spin_ms,
        "images": [name for name, _, _, _ in images],
        "click_images": len(image_ids),
        "client_host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "models": served_models(url, args.api_key),
    }
    rows: list[dict[str, Any]] = []
    pool = None
    if args.processes > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.processes)
    try:
        for n, (label, rates) in enumerate(steps):
            if n:
                time.sleep(args.pause_seconds)
            spec = replace(base, rates=rates, seed=args.seed * 1000 + n)
            log.info("%s: %s for %g s after %g s warm-up", label, dict(rates), args.seconds,
                     args.warmup_seconds)  # fmt: skip
            # client processes start (spawn, imports) during the first step's lead-in
            lead_in_s = 0.5 if pool is None else 3.0 if n == 0 else 1.0
            cores: list[float] = []
            samples = run_step(spec, pool, lead_in_s, cores)
            for kind, rate in rates:
                row = report.summarize(samples, label, kind, rate, args.warmup_seconds,
                                       args.seconds)  # fmt: skip
                row["client_cores"] = cores[0]
                log.info("%s", report.table([row]).splitlines()[-1])
                rows.append(row)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    sys.stdout.write(report.table(rows) + "\n" + report.phase_table(rows))
    sys.stdout.write(report.client_cpu_lines(rows))
    if args.json is not None:
        report.write_json(args.json, run, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
