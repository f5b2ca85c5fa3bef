"""Where does loading SAM's encoder package go? Issue 21's warm starts spent 51 to 54 s in
`load_package` plus the first run of a package that took 108 s to build on an H100.

Three steps, each in a fresh process so nothing is cached in memory between them:

    python3 -m bench.aot_load build --dir /tmp/aot-probe      # the served package (vit_b)
    python3 -m bench.aot_load load --dir /tmp/aot-probe       # timed, step by step
    python3 -m bench.aot_load load --dir /tmp/aot-probe --single-threaded --graph

`load` times the archive's reading, the loader's construction, the first and later runs,
and lists any child processes the loader starts (a compiler at load would be one); with
`--graph` it captures one replay in a CUDA graph and compares it with the uncaptured run
(`run_single_threaded=True` is torch's documented switch for that). `bench/gpu_aot_load.sh`
adds native stacks sampled by py-spy during the load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import zipfile
from pathlib import Path

import torch
from torch._inductor.package.package import AOTICompiledModel

from models.aot import AotStore, PackageKey, _share_cxx_runtime, device_name, weights_hash
from models.optimize import OptimizeOptions, prepare_sam_encoder
from models.sam import SAM_CONFIGS, load_sam

log = logging.getLogger("bench.aot_load")


def _encoder(device: torch.device, name: str) -> tuple[torch.nn.Module, torch.Tensor, PackageKey]:
    """The encoder as the engine packages it (bf16, SDPA), an example and its key."""
    config = SAM_CONFIGS[name]
    model = load_sam(config, None)
    options = OptimizeOptions(
        precision="bf16" if device.type == "cuda" else "fp32", attention="sdpa", compile_mode="aot"
    )
    prepare_sam_encoder(model.image_encoder, options, device)
    encoder = model.image_encoder.to(device, options.dtype).eval()
    size = config.image_size
    example = torch.zeros(1, 3, size, size, device=device, dtype=options.dtype)
    key = PackageKey(f"sam {name} probe", weights_hash(encoder), "bf16 sdpa", device_name(device))
    return encoder, example, key


def _children(stop: threading.Event, seen: set[str]) -> None:
    """Names of child processes of this one, sampled every 0.2 s (Linux /proc)."""
    me = str(os.getpid())
    while not stop.wait(0.2):
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = status.read_text().split()
            except OSError:
                continue
            if fields[3] == me:
                seen.add(fields[1])


def _timed(label: str, times: dict[str, float], fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times[label] = round(time.perf_counter() - started, 3)
    log.info("%s: %.3f s", label, times[label])
    return out


def build(folder: Path, device: torch.device, name: str) -> None:
    encoder, example, key = _encoder(device, name)
    started = time.perf_counter()
    _, how = AotStore(folder, key).prepare("sam_encoder", encoder, example)
    log.info("package %s (%.1f s)", how, time.perf_counter() - started)


def load(folder: Path, device: torch.device, name: str, single_threaded: bool, graph: bool) -> dict:
    times: dict[str, float] = {}
    encoder, example, key = _timed("model made (random weights)", times, _encoder, device, name)
    package = AotStore(folder, key).path("sam_encoder", tuple(example.shape))
    with zipfile.ZipFile(package) as archive:
        entries = archive.infolist()
    sizes = sorted(((e.file_size, e.filename) for e in entries), reverse=True)
    log.info("package %s: %d files, %.1f MB; largest %s", package.name, len(entries),
             sum(s for s, _ in sizes) / 1e6, [(n, s) for s, n in sizes[:6]])  # fmt: skip
    _share_cxx_runtime()
    stop, seen = threading.Event(), set[str]()
    watcher = threading.Thread(target=_children, args=(stop, seen), daemon=True)
    watcher.start()
    loader = torch._C._aoti.AOTIModelPackageLoader
    runner = _timed("AOTIModelPackageLoader", times, loader, str(package), "model",
                    single_threaded, 1, -1)  # fmt: skip
    fn = AOTICompiledModel(runner)
    with torch.inference_mode():
        for batch in (1, 1, 2, 8):
            x = example.expand(batch, *example.shape[1:]).contiguous()
            _timed(f"run batch {batch}" + (" (again)" if f"run batch {batch}" in times else ""),
                   times, fn, x)  # fmt: skip
        stop.set()
        result: dict = {"times_s": times, "children": sorted(seen), "files": len(entries)}
        reference = encoder(example)
        result["max_abs_vs_eager"] = (fn(example) - reference).abs().max().item()
        if graph:
            result["graph"] = _graph(fn, example)
    return result


def _graph(fn, example: torch.Tensor) -> dict:  # type: ignore[no-untyped-def]
    """Capture one replay of the package; the replay's time and its difference."""
    static = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            expected = fn(static)
    torch.cuda.current_stream().wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(cuda_graph):
            out = fn(static)
    except Exception as exc:  # the finding, not a crash of the probe
        return {"captured": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    timings = {}
    for name, call in (("replay", cuda_graph.replay), ("uncaptured", lambda: fn(static))):
        call()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        timings[f"{name}_ms"] = round((time.perf_counter() - started) / 20 * 1000, 3)
    return {"captured": True, "max_abs_vs_uncaptured": (out - expected).abs().max().item(),
            **timings}  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["build", "load"])
    p.add_argument("--dir", type=Path, default=Path("/tmp/aot-probe"))
    p.add_argument("--model", default="vit_b", choices=sorted(SAM_CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--single-threaded", action="store_true",
                   help="aoti_load_package(run_single_threaded=True)")  # fmt: skip
    p.add_argument("--graph", action="store_true", help="capture a replay in a CUDA graph")
    p.add_argument("--out", type=Path, help="write the load's figures here (JSON)")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.step == "build":
        build(args.dir, device, args.model)
        return
    result = load(
        args.dir, device, args.model, args.single_threaded, args.graph and device.type == "cuda"
    )
    log.info("%s", json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
