"""Which GPUs the engines get, decided by the supervisor without importing torch.

Engine processes per GPU (`SERVE_ENGINES_PER_GPU`: by default up to six under MPS, two
time-sliced, no more than the GPU's memory holds at start-up): each is started with
CUDA_VISIBLE_DEVICES naming its one GPU, so inside it the device is `cuda:0` and nothing
in the engine knows there are others. The GPUs are
counted the way CUDA will see them: the entries of CUDA_VISIBLE_DEVICES when it is set (a
pod's runtime or a user chose them), else `nvidia-smi -L` (a GPU split into MIG instances
counts once per instance, named by its UUID, since a CUDA process can use only one of
them). No nvidia-smi, or it fails: no GPU, one engine.

CUDA_VISIBLE_DEVICES is CUDA's own variable, read here as CUDA would read it (not a
setting; `server.engine.gpu_memory` reads it the same way for its labels).
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from server.settings import Settings, available_cores

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 20.0
_GPU_LINE = re.compile(r"^GPU (\d+):")
_MIG_LINE = re.compile(r"^\s+MIG .*\(UUID: (MIG-[^)\s]+)\)")


@dataclass(frozen=True)
class EnginePlan:
    """One engine process: its index and the environment it starts with beyond ours."""

    index: int
    env: Mapping[str, str]  # CUDA_VISIBLE_DEVICES (and the order) when it has a GPU

    @property
    def role(self) -> str:
        return f"engine-{self.index}"


def parse_visible(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: entries up to the first invalid one ("-1"
    or empty hides every GPU)."""
    devices = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def parse_nvidia_smi(listing: str) -> list[str]:
    """`nvidia-smi -L` -> device names for CUDA_VISIBLE_DEVICES: a GPU's index, or the
    UUIDs of its MIG instances when it is split."""
    devices: list[str] = []
    gpu: str | None = None
    migs: list[str] = []
    for line in listing.splitlines():
        if match := _GPU_LINE.match(line):
            if gpu is not None:
                devices += migs or [gpu]
            gpu, migs = match.group(1), []
        elif (match := _MIG_LINE.match(line)) and gpu is not None:
            migs.append(match.group(1))
    if gpu is not None:
        devices += migs or [gpu]
    return devices


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process's children may use, as CUDA_VISIBLE_DEVICES entries."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return parse_visible(environ["CUDA_VISIBLE_DEVICES"])
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return []  # no driver tools: no GPU
    if done.returncode != 0:
        log.warning("nvidia-smi -L failed (%s): counting no GPU", done.stderr.strip()[:200])
        return []
    return parse_nvidia_smi(done.stdout)


# `SERVE_ENGINES_PER_GPU=auto` on a whole GPU whose engines share it through MPS: one
# engine per two of the host's cores for that GPU, from two to six. Each engine is a GIL
# of its own, and the engines' host work, not the GPU, bounded the README's mix: on an H200
# with 16 cores (the load client on the same host) its p99s went from 1,290 / 802 / 879 ms
# with two engines to 281 / 257 / 159 with four, 172 / 91 / 113 with six and 161 / 87 /
# 110 with eight, the GPU busy about half the time (docs/BENCHMARKS.md, issue 19, nineteenth
# session). Six, not eight: eight gained little more, and each engine holds its own models
# and caches (about 9 GB reserved with vit_b and Swin-T, so six fit an 80 GB H100).
SHARED_ENGINES_MAX = 6
# the SAM models whose engines were measured that small; a larger model keeps two a GPU
# until its memory per engine has been measured
SHARED_SAM_MODELS = frozenset({"vit_tiny", "vit_b"})
# time-sliced engines (no MPS): two held the mix better than one (docs/BENCHMARKS.md)
SLICED_ENGINES = 2
# GPU memory an engine of vit_b and Swin-T needs at its start-up's peak, when the engines
# of a GPU warm up together: six on an 80 GB H100 with the decoder's warm-up masks at 64x64
# (`WARM_MASK_SIDE`) used at most 62,380 of its 81,559 MiB at once, each engine at most
# 11,778 MiB (nvidia-smi every 0.5 s; each engine's own allocator peaked at 11.5 GB
# reserved; docs/BENCHMARKS.md, issue 19, twenty-second session; with full-size warm-up
# masks it was 80,532 MiB). `auto` puts no more engines on a GPU than fit at the engine's
# own peak; a larger model needs more, so this is a floor.
ENGINE_MEMORY_MIB = 11_778


def engines_on(
    gpu: str,
    settings: Settings,
    *,
    shared: bool,
    cores_per_gpu: int,
    memory_of: Callable[[str], int | None] | None = None,
) -> int:
    """Engines `SERVE_ENGINES_PER_GPU` puts on `gpu` (a CUDA_VISIBLE_DEVICES entry). auto:
    one on a MIG instance (MIG slices its GPU itself); two on a whole GPU time-sliced;
    under MPS (`shared`) one per two cores, two to `SHARED_ENGINES_MAX`, for the SAM
    models measured so; never more than the GPU's memory (`memory_of(gpu)`, MiB, asked
    only here; None: unknown) holds at `ENGINE_MEMORY_MIB` each, and at least one."""
    if settings.engines_per_gpu != "auto":
        return int(settings.engines_per_gpu)
    if gpu.startswith("MIG-"):
        return 1
    if not shared or settings.sam_model not in SHARED_SAM_MODELS:
        count = SLICED_ENGINES
    else:
        count = max(SLICED_ENGINES, min(SHARED_ENGINES_MAX, cores_per_gpu // 2))
    memory_mib = None if memory_of is None else memory_of(gpu)
    if memory_mib is not None and count * ENGINE_MEMORY_MIB > memory_mib:
        fit = max(1, memory_mib // ENGINE_MEMORY_MIB)
        log.info("GPU %s: %d MiB hold %d engine(s) of about %d MiB at start-up, not %d",
                 gpu, memory_mib, fit, ENGINE_MEMORY_MIB, count)  # fmt: skip
        count = fit
    return count


def gpu_memory_mib(gpu: str) -> int | None:
    """A whole GPU's memory (`nvidia-smi -i`, which takes the index or UUID that
    CUDA_VISIBLE_DEVICES holds; an index is taken in nvidia-smi's PCI order, the same GPU
    model on the hosts this serves), or None when nvidia-smi cannot say."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
             "-i", gpu],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        return int(done.stdout.split()[0]) if done.returncode == 0 else None
    except (IndexError, ValueError):
        return None


def plan_engines(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    shared: bool | None = None,
    cores: int | None = None,
    memory_of: Callable[[str], int | None] = gpu_memory_mib,
) -> list[EnginePlan]:
    """How many engines, each with its GPU: `SERVE_ENGINES`, or `SERVE_ENGINES_PER_GPU` on
    each visible GPU, in turns (engine-0 on the first GPU, engine-1 on the second, ...).

    `shared`: whether engines on one GPU will run side by side under MPS (by default,
    unless `SERVE_MPS=off`; the supervisor plans again without it when no MPS server
    starts). `cores`: the host's, by default those this process may use. `memory_of`: a
    GPU's memory in MiB (`engines_on` asks it only where `auto` counts engines).

    On the CPU (`SERVE_DEVICE=cpu`, or no GPU) nothing is pinned and any number may run
    (tests); more engines than GPUs share them round robin."""
    gpus = [] if settings.device == "cpu" else visible_gpus(environ)
    if settings.engines == "auto" and gpus:
        shared = settings.mps != "off" if shared is None else shared
        cores_per_gpu = (available_cores() if cores is None else cores) // len(gpus)
        counts = [
            engines_on(
                gpu, settings, shared=shared, cores_per_gpu=cores_per_gpu, memory_of=memory_of
            )
            for gpu in gpus
        ]
        turns = range(max(counts))
        gpus = [g for turn in turns for g, n in zip(gpus, counts, strict=True) if n > turn]
    count = settings.engines if settings.engines != "auto" else max(1, len(gpus))
    if not gpus:
        return [EnginePlan(index, {}) for index in range(count)]
    order = {}
    if "CUDA_VISIBLE_DEVICES" not in environ:
        # nvidia-smi numbers GPUs by PCI bus; CUDA's default order may differ
        order = {"CUDA_DEVICE_ORDER": environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
    if count > len(set(gpus)):
        log.info("%d engines on %d GPUs: some GPUs serve two or more", count, len(set(gpus)))
    return [
        EnginePlan(index, {**order, "CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]})
        for index in range(count)
    ]
