"""Per-machine measurements kept across runs: one JSON file per probe in zoomr's cache folder.

A probe (which half-precision type the CPU runs faster, whether llama.cpp's AMX kernels run here) is measured
once per machine and software build and looked up afterwards. The folder is ``$ZOOMR_CACHE``, else
``$XDG_CACHE_HOME/zoomr``, else ``~/.cache/zoomr``. An unreadable or unwritable cache only means measuring again.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """Where zoomr keeps per-machine measurements."""
    if os.environ.get("ZOOMR_CACHE"):
        return Path(os.environ["ZOOMR_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zoomr"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says: part of every probe's key."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lookup(file: str, key: str) -> dict | None:
    """The entry stored under ``key`` in ``file`` (a JSON object in :func:`cache_dir`), or None."""
    try:
        known = json.loads((cache_dir() / file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    hit = known.get(key) if isinstance(known, dict) else None
    return hit if isinstance(hit, dict) else None


def store(file: str, key: str, entry: dict) -> None:
    """Write ``entry`` under ``key`` in ``file``, keeping the other keys; replaced atomically, errors ignored."""
    path = cache_dir() / file
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    known[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
