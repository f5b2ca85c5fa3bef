"""Drive a running service with N concurrent clients: real JPEGs, one box each.

Prints throughput, p50/p95/p99 latency and the mean batch size per stage (read from the
service's own /metrics), so batching settings can be compared run against run.

    python -m bench.service_load --url http://127.0.0.1:8000 --clients 64 --seconds 30

`--spawn` starts `python -m server` itself once per (max_batch_size, delay) pair given with
`--grid`, e.g. `--grid 1:0 8:2 16:5 32:5`, and prints one row per pair.

Every request names its image in X-Image-Id (its SHA-256), as the service's clients do.
The set-up (embedding the photos before a click run) goes through `server.client`. The
timed requests do not: the client decodes every mask into a numpy array and retries 429s,
and a load generator on the same host must neither spend its CPU on decoding (a random-weight
mask has ~165,000 RLE runs) nor hide the refusals it is there to count.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.stage_times import stage_sums
from server.client import AsyncClient

DEFAULT_IMAGES = Path(__file__).resolve().parents[2] / "shared" / "data" / "images"

Photo = tuple[str, bytes, int, int]  # file name, JPEG bytes, width, height


@dataclass(frozen=True)
class LoadSpec:
    """One load run, as both runners and every client process take it (it is pickled to
    each process whole; `replace` gives a warm-up run or one process's share)."""

    url: str  # one URL, or several with commas: client k talks to replica k mod n
    images: tuple[Photo, ...]
    clients: int
    seconds: float
    route: str = "/v1/segment"
    unique: bool = False  # new bytes per request, so the embedding cache never hits
    clicks: int = 0  # > 0: clicks of this many points on cached embeddings instead


def load_images(folder: Path) -> tuple[Photo, ...]:
    from PIL import Image

    out = []
    for path in sorted(folder.glob("*.jpg")):
        data = path.read_bytes()
        with Image.open(path) as im:
            out.append((path.name, data, im.width, im.height))
    if not out:
        raise SystemExit(f"no .jpg files in {folder}")
    return tuple(out)


def batch_means(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of serve_batch_size per stage, summed over engines (`engine` label)."""
    return stage_sums(metrics_text, "serve_batch_size")


async def embed_all(http: httpx.AsyncClient, images) -> list[str]:
    """Encode each photo once (the annotation tool's first request); their image_ids."""
    client = AsyncClient(str(http.base_url), http=http)
    return [(await client.embed(data)).image_id for _, data, _, _ in images]


async def click_loop(http, rng, images, ids, points: int, stop_at, latencies, server, failures):
    """Interactive annotation: clicks on cached embeddings, by image_id, as JSON."""
    while time.perf_counter() < stop_at:
        k = rng.randrange(len(images))
        _, _, w, h = images[k]
        coords = [[rng.uniform(0, w), rng.uniform(0, h)] for _ in range(points)]
        body = {"image_id": ids[k], "point_coords": coords, "point_labels": [1] * points,
                "multimask_output": True}  # fmt: skip
        started = time.perf_counter()
        try:
            r = await http.post("/v1/segment", json=body, headers={"X-Image-Id": ids[k]})
        except httpx.HTTPError as exc:
            failures.append(repr(exc))
            continue
        if r.status_code != 200 or r.json()["results"][0]["masks"][0]["segmentation"]["size"] != [
            h,
            w,
        ]:
            failures.append(f"{r.status_code} {r.text[:200]}")
            continue
        latencies.append(time.perf_counter() - started)
        server.append(r.json()["timing_ms"]["total"] / 1000)


async def run_load(spec: LoadSpec, seed: int = 0):
    """`spec.clients` clients on this event loop; `seed` tells processes' clients apart."""
    images, route = spec.images, spec.route
    latencies: list[float] = []
    server: list[float] = []  # the service's own timing_ms.total, for --clicks
    failures: list[str] = []
    stop_at = time.perf_counter() + spec.seconds
    limits = httpx.Limits(max_connections=spec.clients, max_keepalive_connections=spec.clients)

    async def client_loop(k: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 100_003 + k)
        if spec.clicks:
            ids = await embed_all(http, images)
            await click_loop(
                http, rng, images, ids, spec.clicks, stop_at, latencies, server, failures
            )
            return
        while time.perf_counter() < stop_at:
            name, data, w, h = rng.choice(images)
            if spec.unique:  # defeat the embedding cache: different bytes, same picture
                data = data + rng.randbytes(16)
            x0, y0 = rng.uniform(0, w / 2), rng.uniform(0, h / 2)
            box = [x0, y0, x0 + w / 3, y0 + h / 3]
            files = {"image": (name, data, "image/jpeg")}
            fields = {"box": box} if route == "/v1/segment" else {"top_k": 5}
            started = time.perf_counter()
            try:
                r = await http.post(
                    route, files=files, data={"request": json.dumps(fields)},
                    headers={"X-Image-Id": hashlib.sha256(data).hexdigest()},
                )  # fmt: skip
                ok = r.status_code == 200
                if ok and route == "/v1/segment":
                    ok = r.json()["results"][0]["masks"][0]["segmentation"]["size"] == [h, w]
                if not ok:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                    continue
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                continue
            latencies.append(time.perf_counter() - started)

    # several replicas (comma-separated URLs): client k talks to replica k mod n, a
    # client-side round robin standing in for the load balancer
    urls = spec.url.split(",")
    https = [httpx.AsyncClient(base_url=u, timeout=120, limits=limits) for u in urls]
    try:
        before = batch_means((await https[0].get("/metrics")).text)
        began = time.perf_counter()
        loops = (client_loop(k, https[k % len(https)]) for k in range(spec.clients))
        await asyncio.gather(*loops)
        elapsed = time.perf_counter() - began
        after = batch_means((await https[0].get("/metrics")).text)
    finally:
        for http in https:
            await http.aclose()
    means = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            means[stage] = (s1 - s0) / (c1 - c0)
    return latencies, failures, elapsed, means, server


def _load_process(job: tuple[LoadSpec, int]) -> tuple[list[float], list[str], float, list[float]]:
    """One client process: its share of the clients, on its own event loop."""
    spec, seed = job
    latencies, failures, elapsed, _, server = asyncio.run(run_load(spec, seed))
    return latencies, failures, elapsed, server


def run_load_processes(spec: LoadSpec, procs: int):
    """Spread the clients over `procs` processes, so the load generator is not the limit."""
    if procs <= 1:
        return asyncio.run(run_load(spec))
    first = spec.url.split(",")[0]  # batch sizes as the first replica saw them
    before = batch_means(httpx.get(first + "/metrics", timeout=30).text)
    clients = spec.clients
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    jobs = [(replace(spec, clients=n), i) for i, n in enumerate(shares) if n]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        results = pool.map(_load_process, jobs)
    after = batch_means(httpx.get(first + "/metrics", timeout=30).text)
    latencies = [x for r in results for x in r[0]]
    failures = [x for r in results for x in r[1]]
    server = [x for r in results for x in r[3]]
    elapsed = max(r[2] for r in results)
    means = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            means[stage] = (s1 - s0) / (c1 - c0)
    return latencies, failures, elapsed, means, server


def _quantiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=100) if len(values) >= 2 else [float("nan")] * 99


def summarize(
    latencies: list[float], failures: list[str], elapsed: float, means, server: list[float]
) -> dict:
    qs = _quantiles(latencies)
    extra = {}
    if server:  # the service's own view (timing_ms.total), without the HTTP hop
        sq = _quantiles(server)
        extra = {"server_p50_ms": sq[49] * 1000, "server_p99_ms": sq[98] * 1000}
    return {
        **extra,
        "requests": len(latencies),
        "failed": len(failures),
        "req_per_s": len(latencies) / elapsed,
        "p50_ms": qs[49] * 1000,
        "p95_ms": qs[94] * 1000,
        "p99_ms": qs[98] * 1000,
        "mean_batch": {k: round(v, 2) for k, v in means.items()},
    }


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server not ready in time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="one URL, or several with commas")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--warmup-seconds", type=float, default=3)
    p.add_argument("--route", default="/v1/segment", choices=["/v1/segment", "/v1/classify"])
    p.add_argument("--images", type=Path, default=DEFAULT_IMAGES)
    p.add_argument("--unique", action="store_true", help="new bytes per request (no cache hits)")
    p.add_argument(
        "--clicks", type=int, default=0, help="N points per click on cached embeddings (issue 5)"
    )
    p.add_argument("--spawn", action="store_true", help="start the server for each grid point")
    p.add_argument("--grid", nargs="*", default=["8:5"], help="max_batch_size:delay_ms pairs")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--procs", type=int, default=1, help="client processes")
    p.add_argument("--server-log", type=Path, default=None, help="append the server's log here")
    p.add_argument("--metrics-out", type=Path, default=None, help="save /metrics after each run")
    p.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for --spawn")
    args = p.parse_args()
    images = load_images(args.images)
    rows = []
    for point in args.grid if args.spawn else ["(running server)"]:
        proc = None
        url = args.url
        ready_s = None
        if args.spawn:
            batch, delay = point.split(":")
            url = f"http://127.0.0.1:{args.port}"
            extra = dict(kv.split("=", 1) for kv in args.server_env)
            env = {
                **os.environ,
                **extra,
                "SERVE_MAX_BATCH_SIZE": batch,
                "SERVE_MAX_QUEUE_DELAY_MS": delay,
            }
            log = args.server_log.open("a") if args.server_log else subprocess.DEVNULL
            proc = subprocess.Popen(
                [sys.executable, "-m", "server", "--port", str(args.port)], env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            ready_s = wait_ready(url, proc)
            print(f"{point}: ready after {ready_s:.1f}s", flush=True)
        try:
            spec = LoadSpec(
                url=url,
                images=images,
                clients=args.clients,
                seconds=args.seconds,
                route=args.route,
                unique=args.unique,
                clicks=args.clicks,
            )
            if args.warmup_seconds:
                run_load_processes(replace(spec, seconds=args.warmup_seconds), args.procs)
            row = summarize(*run_load_processes(spec, args.procs))
            if args.metrics_out is not None:
                text = httpx.get(url.split(",")[0] + "/metrics", timeout=30).text
                with args.metrics_out.open("a") as f:
                    f.write(f"# ---- {point}\n{text}")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=120)
        row = {"config": point, "clients": args.clients, "ready_s": ready_s, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| batch:delay_ms | clients | req/s | p50 ms | p95 ms | p99 ms | mean batch | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [
            r["config"],
            r["clients"],
            f"{r['req_per_s']:.1f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p95_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            r["mean_batch"],
            r["failed"],
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
