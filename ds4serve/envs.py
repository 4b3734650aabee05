"""Every environment variable ds4serve reads, declared once and read only through this module.

Each variable has a name, a type, a default and a one-line doc; ``docs/ENVIRONMENT.md`` is
generated from this registry (``python -m ds4serve.envdoc``) and a test fails
when the file is stale or when code elsewhere reads ``os.environ`` directly.

Booleans: unset, ``0``, ``false``, ``no``, ``off`` are off; ``1``, ``true``, ``yes``, ``on`` are on;
anything else is an error naming the variable.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # "bool" | "int" | "float" | "str" | "path" | "log_level"
    default: Any
    doc: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        return _PARSERS[self.kind](self.name, raw.strip())


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r}: expected an integer") from exc


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError as exc:
        raise EnvError(f"{name}={raw!r}: expected a number") from exc


def _parse_log_level(name: str, raw: str) -> str:
    levels = [n for n in logging.getLevelNamesMapping() if n not in ("NOTSET", "WARN", "FATAL")]
    if raw.upper() not in levels:
        raise EnvError(f"{name}={raw!r}: expected one of {', '.join(levels)}")
    return raw.upper()


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "bool": _parse_bool,
    "int": _parse_int,
    "float": _parse_float,
    "str": lambda _name, raw: raw,
    "path": lambda _name, raw: Path(raw).expanduser(),
    "log_level": _parse_log_level,
}

REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, kind: str, default: Any, doc: str) -> EnvVar:
    if kind not in _PARSERS:
        raise ValueError(f"{name}: kind must be one of {sorted(_PARSERS)}, got {kind!r}")
    if name in REGISTRY:
        raise ValueError(f"{name}: declared twice")
    var = EnvVar(name, kind, default, doc)
    REGISTRY[name] = var
    return var


API_KEY = _declare(
    "DS4SERVE_API_KEY",
    "str",
    None,
    "The API key `ds4serve serve` requires when --api-key is not given (kept out of the process list).",
)
CACHE_DIR = _declare(
    "DS4SERVE_CACHE_DIR",
    "path",
    Path.home() / ".cache" / "ds4serve",
    "Where the built-in default tiny model (and other generated artefacts) are cached.",
)
GPU_PROFILE = _declare(
    "DS4SERVE_GPU_PROFILE",
    "bool",
    False,
    "Enable the per-phase GPU profiler (same as --gpu-profile). Off means no events, no syncs, no output.",
)
GPU_PROFILE_FILE = _declare(
    "DS4SERVE_GPU_PROFILE_FILE", "path", None, "Also write profiler records as JSON lines to this file."
)
LOG_LEVEL = _declare(
    "DS4SERVE_LOG_LEVEL",
    "log_level",
    "INFO",
    "Python logging level for ds4serve's loggers (DEBUG, INFO, WARNING, ...). At DEBUG the command line also "
    "prints the traceback of a bad option or input, which it otherwise reports in one line.",
)
TIMING = _declare(
    "DS4SERVE_TIMING",
    "bool",
    False,
    "Log one line of host wall times and tokens/s per request (prefill, decode, verify, draft) and put the "
    "same numbers in the result's stats.host_timing.",
)


def get(var: EnvVar) -> Any:
    """The current value of a registered variable."""
    return var.get()


def markdown() -> str:
    """``docs/ENVIRONMENT.md``, generated from the registry."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `ds4serve/envs.py` by `python -m ds4serve.envdoc`; do not edit.",
        "",
        "Booleans accept `1`/`true`/`yes`/`on` and `0`/`false`/`no`/`off` (unset is off); other values are an error.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for var in sorted(REGISTRY.values(), key=lambda v: v.name):
        lines.append(f"| `{var.name}` | {var.kind} | {_shown_default(var.default)} | {var.doc} |")
    return "\n".join(lines) + "\n"


def _shown_default(default: Any) -> str:
    """A default as the doc shows it: the same on every machine (paths under home start with ``~``)."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return f"`{int(default)}`"
    if isinstance(default, Path) and default.is_relative_to(Path.home()):
        return f"`~/{default.relative_to(Path.home()).as_posix()}`"
    return f"`{default}`"
