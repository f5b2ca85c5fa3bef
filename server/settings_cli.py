"""The settings as a user meets them: `python -m server --help`, and one line per mistake.

The help is generated from `Settings` (each field's type, default and docstring), so it
cannot drift from the code. A bad `SERVE_` value stops start-up with one line naming the
variable and what is wrong, exit status 2, instead of a pydantic traceback.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from models.sam import SAM_CONFIGS
from models.sam2 import SAM2_CONFIGS
from models.swin import SWIN_CONFIGS
from server.settings import CPU_DEFAULTS, SAM_MODEL_ALIASES, Settings

PREFIX = "SERVE_"


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def _size(value: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return str(value)


def default_text(name: str, field: FieldInfo) -> str:
    """The default as the environment would spell it (JSON lists, lower-case booleans)."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(str(v) if not isinstance(v, str) else f'"{v}"' for v in value) + "]"
    if isinstance(value, int) and name.endswith("_bytes"):
        return _size(value)
    return str(value)


def settings_help() -> str:
    """Every setting: its variable, default and meaning, in the class's order."""
    lines = ["settings (environment variables; a list or bool as JSON, e.g. [1,2,4] or true):"]
    for name, field in Settings.model_fields.items():
        default = default_text(name, field)
        if name in CPU_DEFAULTS:
            cpu = CPU_DEFAULTS[name]
            default += f"; CPU: {_size(cpu) if name.endswith('_bytes') else cpu}"
        lines.append(f"  {env_name(name)}  (default: {default})")
        description = field.description or ""
        lines += textwrap.wrap(description, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def _problem(error: Mapping[str, Any]) -> str:
    loc = tuple(error.get("loc") or ())
    message = str(error.get("msg", "invalid"))
    message = message.removeprefix("Value error, ")
    if not loc:  # a check across fields: its message names the variables itself
        return message
    name = env_name(str(loc[0]))
    return f"{name}={error.get('input')!r}: {message}"


def describe(exc: ValidationError | SettingsError) -> str:
    """One line saying which `SERVE_` variable is wrong and how."""
    if isinstance(exc, ValidationError):
        return "bad setting: " + "; ".join(_problem(e) for e in exc.errors())  # type: ignore[arg-type]
    # pydantic-settings could not parse a JSON value (a list, a dict) from the environment
    match = re.search(r'field "(\w+)"', str(exc))
    field = env_name(match.group(1)) if match else "a SERVE_ variable"
    why = f" ({exc.__cause__})" if exc.__cause__ else ""
    return f"bad setting: {field} is not valid JSON{why}; a list looks like [1,2,4]"


def sam_model_names() -> list[str]:
    """Every name SERVE_SAM_MODEL accepts: SAM's, SAM 2.1's and their other spellings."""
    return [*SAM_CONFIGS, *SAM2_CONFIGS, *SAM_MODEL_ALIASES]


def sam2_problems(settings: Settings) -> list[str]:
    """What the SAM 2 service does not do yet, refused before anything loads."""
    name = f"SERVE_SAM_MODEL={settings.sam_model!r}"
    problems = []
    if settings.quantization != "none" or settings.sparsity != "none":
        problems.append(
            f"{name}: int8, fp8 and 2:4 make SAM 2's encoder slower and less faithful than "
            "bf16 (hiera_large on an H100: int8 107 and fp8 106 against 142 img/s, mask IoU "
            "0.979 and 0.855; on an H200: 2:4 110 against 150 img/s, mask IoU 0.47; "
            "docs/BENCHMARKS.md); use SERVE_QUANTIZATION=none and SERVE_SPARSITY=none"
        )
    return problems


def model_problems(settings: Settings) -> list[str]:
    """Settings pydantic accepts but no model answers to: caught before anything loads."""
    problems = []
    if settings.enable_sam and settings.sam_model in SAM2_CONFIGS:
        problems += sam2_problems(settings)
    elif settings.enable_sam and settings.sam_model not in SAM_CONFIGS:
        problems.append(f"SERVE_SAM_MODEL={settings.sam_model!r}: one of {sam_model_names()}")
    if settings.enable_swin and settings.swin_model not in SWIN_CONFIGS:
        problems.append(f"SERVE_SWIN_MODEL={settings.swin_model!r}: one of {list(SWIN_CONFIGS)}")
    if settings.compile_mode == "aot" and settings.attention == "flex":
        problems.append(
            "SERVE_ATTENTION='flex': AOT packages (SERVE_COMPILE_MODE=aot) are not built with "
            "it; use auto, sdpa or triton"
        )
    for name in ("sam_checkpoint", "swin_checkpoint", "fidelity_images", "calibration_images"):
        path = getattr(settings, name)
        if path is not None and not path.exists():
            problems.append(f"{env_name(name)}={str(path)!r}: no such file or folder")
    return problems


def load_settings() -> Settings:
    """The settings from the environment; `BadSettingError` with one line when one is bad."""
    try:
        settings = Settings()
    except (ValidationError, SettingsError) as exc:
        raise BadSettingError(describe(exc)) from None
    problems = model_problems(settings)
    if problems:
        raise BadSettingError("bad setting: " + "; ".join(problems))
    return settings


class BadSettingError(ValueError):
    """A setting the service cannot start with; its message is the one line to show."""
