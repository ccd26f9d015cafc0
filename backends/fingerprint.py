"""A model's identity on disk: the sha256 of the bytes loading reads (a GGUF file, or a HF directory's files).

Provenance records it with every result (:mod:`zoomr.evaluation.provenance`), and per-model caches are keyed by it
(TriAttention's query statistics, :mod:`zoomr.backends.query_stats`). Hashing a multi-GB model takes seconds, so
:func:`model_sha256` keeps each digest in the machine cache (:mod:`zoomr.backends.machine_cache`) under the files'
paths, sizes and modification times, and hashes again only when one of those changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path

from . import machine_cache
from .models import HF_FILE_PATTERNS

CHUNK = 1 << 20  # 1 MiB reads: hashing a multi-GB model stays at constant memory
HASHES_FILE = "model_sha256.json"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (same digest as ``sha256sum``).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def model_files(path: Path) -> list[Path]:
    """The files of a HF directory that loading reads (:data:`zoomr.backends.models.HF_FILE_PATTERNS` at its top
    level), sorted by name."""
    return sorted(p for p in path.iterdir()
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in HF_FILE_PATTERNS))


def model_fingerprint(path: Path) -> dict:
    """sha256 and size of a model on disk.

    A GGUF file is hashed as is. A HF directory is hashed file by file over :func:`model_files`; ``model_sha256``
    is then the sha256 of the ``sha256sum``-style listing of those files sorted by name (``"<hex>  <name>\\n"`` per
    file), so ``cd DIR && sha256sum $(ls FILES | sort) | sha256sum`` reproduces it, and ``model_files`` keeps the
    per-file digests to tell which file differs.

    Returns:
        ``{"model_sha256", "model_bytes"}`` plus ``"model_files": {name: hex}`` for a directory; the values are
        None when ``path`` is neither a file nor a directory.
    Raises:
        OSError: a file exists but cannot be read.
    """
    if path.is_file():
        return {"model_sha256": sha256_file(path), "model_bytes": path.stat().st_size}
    if path.is_dir():
        files = model_files(path)
        digests = {p.name: sha256_file(p) for p in files}
        listing = "".join(f"{d}  {name}\n" for name, d in digests.items())
        return {"model_sha256": hashlib.sha256(listing.encode()).hexdigest(),
                "model_bytes": sum(p.stat().st_size for p in files), "model_files": digests}
    return {"model_sha256": None, "model_bytes": None}


def model_sha256(path: Path) -> str:
    """:func:`model_fingerprint`'s ``model_sha256``, looked up in the machine cache when the files (paths, sizes,
    modification times in ns) are as they were when it was computed.

    Raises:
        OSError: the model cannot be read.
        ValueError: ``path`` is neither a file nor a directory.
    """
    path = Path(path).resolve()
    files = [path] if path.is_file() else model_files(path) if path.is_dir() else None
    if files is None:
        raise ValueError(f"{path}: no such model file or directory")
    key = str(path) + "|" + "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    hit = machine_cache.lookup(HASHES_FILE, key)
    if hit is not None and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = model_fingerprint(path)["model_sha256"]
    machine_cache.store(HASHES_FILE, key, {"sha256": digest})
    return digest
