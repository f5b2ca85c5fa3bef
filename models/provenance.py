"""Where a checkpoint's weights come from, said by a sidecar file beside it.

Meta's checkpoint format is a bare state dict, loaded by a strict `load_state_dict`, so a
file cannot carry a label inside itself without breaking Meta's loader. Synthetic weights
(`python -m models.weights synthesize`) therefore get `<file>.json` beside `<file>`: what
they are, how they were made, what they measured, and the SHA-256 of the file's bytes.
`weights_label` names the weights for `/v1/models` and every response:

- no checkpoint: "random" (seeded random weights);
- a sidecar that says "synthetic" and whose SHA-256 matches the file: "synthetic";
- anything else (no sidecar, an unreadable one, or one for other bytes: the file was
  edited or replaced after the sidecar was written): the file's name, as for any
  checkpoint. A stale sidecar never lends its label to other weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = [
    "SYNTHETIC",
    "read_provenance",
    "sha256_file",
    "sidecar_path",
    "weights_label",
    "write_sidecar",
]

log = logging.getLogger(__name__)
SYNTHETIC = "synthetic"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sidecar_path(checkpoint: Path) -> Path:
    """`weights/sam_vit_b_synthetic.pth` -> `weights/sam_vit_b_synthetic.pth.json`."""
    return checkpoint.with_name(checkpoint.name + ".json")


def write_sidecar(checkpoint: Path, provenance: dict[str, Any]) -> Path:
    """Write `provenance` plus the file's name, size and SHA-256 beside `checkpoint`
    (through a temporary file and a rename, so a reader never sees half of it)."""
    record = {
        **provenance,
        "file": checkpoint.name,
        "size": checkpoint.stat().st_size,
        "sha256": sha256_file(checkpoint),
    }
    target = sidecar_path(checkpoint)
    partial = target.with_name(target.name + ".part")
    partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(partial, target)
    return target


def read_provenance(checkpoint: Path | str) -> dict[str, Any] | None:
    """The sidecar's record if there is one and it describes these very bytes, else None
    (with a warning when a sidecar exists but is unreadable or stale)."""
    path = Path(checkpoint)
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        return None
    try:
        record = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: not readable JSON (%s)", sidecar, exc)
        return None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        log.warning("ignoring %s: no sha256 field", sidecar)
        return None
    try:
        size_ok = path.stat().st_size == record.get("size", -1)
        digest = sha256_file(path) if size_ok else None
    except OSError as exc:
        log.warning("ignoring %s: cannot read %s (%s)", sidecar, path, exc)
        return None
    if digest != record["sha256"]:
        log.warning(
            "ignoring %s: it describes other bytes than %s (edited or replaced since)",
            sidecar,
            path,
        )
        return None
    return record


def weights_label(checkpoint: Path | str | None) -> str:
    """ "random", "synthetic", or the checkpoint's file name (see the module docstring)."""
    if checkpoint is None:
        return "random"
    record = read_provenance(checkpoint)
    if record is not None and record.get("weights") == SYNTHETIC:
        return SYNTHETIC
    return Path(checkpoint).name
