"""Ahead-of-time compiled stages: one `torch.export` + AOTInductor package per warmed shape.

Why: compiling with torch.compile at every start took minutes on a GPU (262 s cold, 68 s
with warm inductor caches; issue 21), while loading a package is well under a second.
A package is a `.pt2` file of generated C++/CUDA code and the weights, keyed by
everything that decides its contents: the model, a hash of its weights, the variant
(precision, quantization, ...), the device, the torch version and a hash of this
package's own source (`code_version`). The store lays packages out by model, variant and
device; each carries a manifest of its full key, so one that no longer matches (new
weights, torch or code) is rebuilt with a log line saying what changed, and one that
fails to load or run (a truncated copy) is rebuilt, saying why.

One package serves every batch size of a stage: it is exported with a dynamic batch
dimension (up to `MAX_BATCH`), so a start loads one file per model however many buckets
it warms, and a cold start builds one (each build ran C++ and Triton compilers for about
100 s on an H100 machine). Limits: the other dimensions are static, buckets not prepared
run eagerly, and a Python custom op cannot be called from the packaged C++: our Triton
attention (`models.sam.fused_attention`) is exported through a traceable twin instead, so
the package carries the kernel (SAM's encoder with `SERVE_ATTENTION=triton`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from models.dynamo_import import preimported

__all__ = ["AotBuckets", "AotStore", "PackageKey", "code_version", "device_name", "weights_hash"]

log = logging.getLogger(__name__)

_MODELS = Path(__file__).resolve().parent


@functools.cache
def code_version() -> str:
    """A hash of every source file under `models/`: what defines the exported graphs.

    Once per process: the modules that made the graphs were imported at its start.
    """
    digest = hashlib.sha256()
    for path in sorted(_MODELS.rglob("*.py")):
        digest.update(str(path.relative_to(_MODELS)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    """The device as generated code depends on it: GPU model and capability, or CPU ISA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


_MULTIPLIERS = (2654435761, 2246822519)  # odd, so consecutive positions get unrelated weights
_WEIGHT_BITS = 24  # 255 * 2**24 * n stays below 2**63 for tensors of up to 2**31 bytes


def _fold(data: Tensor) -> Tensor:
    """Two position-weighted sums of `data`'s bytes, exact in int64 on its own device; a
    change of any one byte changes both (its weight is never 0 and the sums never wrap)."""
    position = torch.arange(data.numel(), device=data.device, dtype=torch.int64)
    values = data.to(torch.int64)
    mask = (1 << _WEIGHT_BITS) - 1
    return torch.stack([(values * ((position * m) & mask | 1)).sum() for m in _MULTIPLIERS])


def weights_hash(module: nn.Module) -> str:
    """A hash of the module's parameters and buffers (names, dtypes, shapes and bytes).

    The bytes are folded where they live (`_fold`) and only the sums come to the host, in
    one copy: copying a GPU model's 180 MB to the host and hashing it there took 1.7 s of
    every warm start on the H100 machine (issue 21).
    """
    digest = hashlib.sha256()
    sums = []
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        try:
            data = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
        except (RuntimeError, TypeError, NotImplementedError):
            continue  # a tensor subclass (packed quantized weights): named by the variant
        sums.append(_fold(data))
    if sums:
        digest.update(torch.stack(sums).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class PackageKey:
    """Everything a package's contents depend on; a package whose key differs is stale."""

    model: str
    weights: str
    variant: str
    device: str
    torch: str = torch.__version__
    code: str = ""

    def changes(self, other: PackageKey) -> str:
        """`field: old -> new` for each field that differs ('' when none)."""
        old, new = asdict(other), asdict(self)
        return ", ".join(f"{k}: {old[k]} -> {new[k]}" for k in new if old[k] != new[k])


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "+-." else "_" for c in text)


@functools.cache
def _share_cxx_runtime() -> None:
    """Put the process's libstdc++ in the global symbol scope, once, before a package loads.

    A package's `.so` carries its own copies of the C++ templates it uses (std::regex, in
    the device-string parser its constructor runs) and, when built with a compiler that
    does not link libstdc++ (the GPU image's `CXX=/opt/gcc/bin/g++`), no dependency on it.
    torch loads libstdc++ privately (Python's extensions are opened RTLD_LOCAL), so the
    package's copies bound to themselves and met locale facets made by the real library:
    a segmentation fault in `regex_traits::transform_primary` at load, for every package,
    CPU or CUDA (bench/gpu_aot_diag.sh, docs/BENCHMARKS.md). Opening the library again
    with RTLD_GLOBAL makes the package bind to the one the process already uses, as an
    LD_PRELOAD of it did on that machine.
    """
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
    except OSError as exc:  # a static or absent runtime: nothing to share
        log.debug("libstdc++ not opened globally (%s)", exc)


def load_package(package: Path) -> Callable[..., Tensor]:
    """The package's runner, after making the C++ runtime one for the package and torch.

    torch's C++ loader directly, not `aoti_load_package`: that one first compares the
    package's recorded machine with this one, and finding this CPU's vector ISA means
    compiling and loading a test library per ISA, each loaded in a new Python process that
    imports torch: 40 to 49 s of a warm start on the H100 machine, where the load itself
    took 0.15 s (bench/aot_load.py, py-spy in bench/gpu_startup.sh; issue 21). The store's
    key names the device already, so a package for another machine is never loaded.

    Single-threaded: the default runner synchronises between runs, which invalidated a
    CUDA graph's capture (issue 21); without it one replay of the captured package matched
    the package run directly exactly, 4.1 against 4.4 ms for one SAM image on an H100.
    A stage calls its package from its one worker thread only.
    """
    _share_cxx_runtime()
    # model name, single-threaded, runners, device (the current one)
    loader = torch._C._aoti.AOTIModelPackageLoader(  # type: ignore[attr-defined]
        str(package), "model", True, 1, -1
    )
    return _Runner(loader)


class _Runner:
    """A loaded package, called with its tensors; its outputs in their exported structure.

    torch's own wrapper (`AOTICompiledModel`) lives in torch._inductor, whose import pulls
    in torch._dynamo: 7 s of a warm start on the H100 machine for nothing a package needs.
    """

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *inputs: Tensor) -> Any:
        return pytree.tree_unflatten(self._loader.boxed_run(list(inputs)), self._out_spec)


MAX_BATCH = 256  # the largest batch a package accepts (the settings' own limit)


class AotStore:
    """Packages of one model (one key) in `folder`; `prepare` loads one or builds it."""

    def __init__(self, folder: Path, key: PackageKey) -> None:
        self.key = key if key.code else replace(key, code=code_version())
        self.folder = folder / _slug(key.model) / _slug(key.variant) / _slug(key.device)
        self._loaded: dict[Path, Callable[[Tensor], Tensor]] = {}

    def path(self, stage: str, shape: tuple[int, ...]) -> Path:
        """The package of `stage` for inputs of `shape`, whatever its batch size (`N`)."""
        return self.folder / f"{_slug(stage)}-{'x'.join(['N', *map(str, shape[1:])])}.pt2"

    def why_rebuild(self, package: Path) -> str | None:
        """Why the package at `package` cannot be used as it is; None when it can."""
        manifest = package.with_suffix(".json")
        if not package.exists() or not manifest.exists():
            return "no package yet"
        try:
            stored = PackageKey(**json.loads(manifest.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            return f"corrupt manifest ({type(exc).__name__})"
        changes = self.key.changes(stored)
        return f"stale ({changes})" if changes else None

    def prepare(
        self, stage: str, module: nn.Module, example: Tensor
    ) -> tuple[Callable[[Tensor], Tensor], str]:
        """The packaged `module` for `example`'s shape and how it was got (for the log)."""
        package = self.path(stage, tuple(example.shape))
        started = time.perf_counter()
        fn: Callable[[Tensor], Tensor]
        if package in self._loaded:  # another bucket of this stage loaded it already
            fn = self._loaded[package]
            with torch.inference_mode():
                fn(example)
            return fn, f"shared package, checked in {time.perf_counter() - started:.2f}s"
        why = self.why_rebuild(package)
        if why is None:
            try:
                fn = load_package(package)
                with torch.inference_mode():
                    fn(example)  # a truncated .so can load and then fail: check it runs
                self._loaded[package] = fn
                return fn, f"loaded in {time.perf_counter() - started:.2f}s"
            except Exception as exc:  # any failure to load or run means: build it again
                why = f"corrupt ({type(exc).__name__}: {str(exc)[:120]})"
        log.info("AOT package %s: building (%s)", package.name, why)
        fn = self._build(package, module, example)
        self._loaded[package] = fn
        return fn, f"built in {time.perf_counter() - started:.1f}s ({why})"

    def _build(self, package: Path, module: nn.Module, example: Tensor) -> Callable[..., Tensor]:
        package.parent.mkdir(parents=True, exist_ok=True)
        preimported()  # export imports torch._dynamo too
        exported = export_batched(module, example)
        # written aside and renamed: a process killed mid-build, or two replicas building
        # at once, never leave a half-written package under the real name
        partial = package.with_name(f".{package.name}.{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(partial),
            inductor_configs={
                # the wrapper only launches kernels: optimising its C++ costs build time
                "aot_inductor.compile_wrapper_opt_level": "O0",
                # and a GPU package's CPU code is that wrapper: trust the CPU's flags rather
                # than compile and load a test library per vector ISA, each in a new Python
                # process importing torch (tens of seconds on the H100 machine; load_package)
                **({"cpp.vec_isa_ok": True} if example.device.type == "cuda" else {}),
            },
        )
        os.replace(partial, package)
        manifest = package.with_suffix(".json")
        partial_manifest = manifest.with_name(f".{manifest.name}.{os.getpid()}.tmp")
        partial_manifest.write_text(json.dumps(asdict(self.key), indent=1))
        os.replace(partial_manifest, manifest)
        return load_package(package)


_exporting = False


def exporting() -> bool:
    """Whether `export_batched` is tracing: model code with a path only a package can carry
    (SAM's attention kernel as a `triton_op`, `models.sam.fused_attention.rel_pos_flash`)
    takes it then, and only then.

    Not `torch.compiler.is_exporting()`: torch 2.11's dynamo folds that to True under every
    `torch.compile`, so the compiled encoder took the export path and failed to compile on
    the GPU (2026-11-27). Dynamo reads this flag as the global it is, and guards on it.
    """
    return _exporting


def export_batched(module: nn.Module, example: Tensor) -> torch.export.ExportedProgram:
    """`module` traced by torch.export with a dynamic batch (1 to `MAX_BATCH`), as a
    package is built from it.

    Exported from a batch of two: an example of one would be specialised to one. Model code
    that asks `exporting()` takes its traceable path here.
    """
    global _exporting
    two = example[:1].expand(2, *example.shape[1:]).contiguous()
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    _exporting = True
    try:
        with torch.no_grad():
            return torch.export.export(module, (two,), dynamic_shapes=({0: batch},))
    finally:
        _exporting = False


class AotBuckets:
    """A stage's module with one AOT package per prepared input shape.

    Shapes never prepared run the module eagerly, as `eager_on_recompile` does for
    torch.compile: serving never stops to compile.
    """

    def __init__(self, module: nn.Module, store: AotStore, stage: str) -> None:
        self.module = module
        self.store = store
        self.stage = stage
        self._fns: dict[tuple[int, ...], Callable[[Tensor], Tensor]] = {}

    def prepare(self, example: Tensor) -> str:
        """Load (or build) the package for `example`'s shape; says how, for the log."""
        fn, how = self.store.prepare(self.stage, self.module, example)
        self._fns[tuple(example.shape)] = fn
        log.info("AOT %s %s: %s", self.stage, tuple(example.shape), how)
        return how

    def __call__(self, x: Tensor) -> Tensor:
        fn = self._fns.get(tuple(x.shape))
        return self.module(x) if fn is None else fn(x)
