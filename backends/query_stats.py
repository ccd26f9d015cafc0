"""TriAttention's query statistics on disk: one safetensors file per model, cached beside the machine caches.

:class:`zoomr.kvstore.triattention.TriAttentionPolicy` scores keys with a model's calibrated pre-RoPE query
statistics (:class:`zoomr.kvstore.triattention.QueryStats`). They are computed once per model
(:func:`zoomr.backends.torch.calibrate.calibrate`: a forward pass over text) and kept in
``<cache>/triattention/<model sha256>.safetensors`` (the folder of :func:`zoomr.backends.machine_cache.cache_dir`),
written to a temporary file and renamed into place, so an interrupted calibration leaves nothing half-written.

The file holds ``q_mean_real``, ``q_mean_imag``, ``q_abs_mean`` ([L, H, F] float32) and ``omega`` ([F] float64,
the RoPE inverse frequencies they were taken under); its header (safetensors metadata, strings) names the
format, the model (sha256, name), its RoPE (theta, scaling as JSON, head size) and shapes (layers, query and KV
heads), and the calibration (tokens of text, its source). A file is used only when its RoPE and shapes are the
model's: statistics taken under another RoPE would score every key at the wrong angle (the reference refuses a
mismatched file the same way: ``verify_rotary_alignment`` in ``triattention/methods/pruning_utils.py``).

Source: the file's content is the reference's (``scripts/calibrate.py``: ``q_mean_real``, ``q_mean_imag``,
``q_abs_mean`` per layer and head); its format (safetensors, not a pickle) and header are zoomr's.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from zoomr.kvstore.triattention import QueryStats

from .fingerprint import model_sha256
from .machine_cache import cache_dir

FORMAT = "zoomr-triattention-query-stats"
VERSION = "1"
SUBDIR = "triattention"
OMEGA_RTOL = 1e-6   # inverse frequencies computed in float64 from the same theta and scaling agree far closer


class StatsFileError(ValueError):
    """A statistics file that is missing, corrupt, or taken under another RoPE or model shape than the model's."""


@dataclass(frozen=True)
class RopeSpec:
    """What a statistics file must match in a model: its RoPE and its attention shapes.

    Attributes:
        theta: RoPE base; scaling: the HF-style ``rope_scaling`` dict or None; head_dim: elements per head.
        n_layers, n_heads, n_kv_heads: layers, query heads and KV heads per layer.
        omega: [head_dim / 2] float64, the inverse frequencies RoPE rotates by (scaling and any GGUF
            ``rope_freqs`` divisors applied; radians per position).
    """

    theta: float
    scaling: dict | None
    head_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    omega: torch.Tensor

    def words(self) -> str:
        """``theta 100000, no scaling, head size 64, 30 layers × 9 query / 3 KV heads``."""
        scaling = json.dumps(self.scaling, sort_keys=True) if self.scaling else "no scaling"
        return (f"theta {self.theta:g}, {scaling}, head size {self.head_dim}, {self.n_layers} layers × "
                f"{self.n_heads} query / {self.n_kv_heads} KV heads")


def stats_dir() -> Path:
    """The folder of the cached statistics files (``<cache>/triattention``)."""
    return cache_dir() / SUBDIR


def cached_path(sha256: str) -> Path:
    """Where the statistics of the model with this sha256 are cached."""
    return stats_dir() / f"{sha256}.safetensors"


def write_stats(path: Path, stats: QueryStats, rope: RopeSpec, *, model_sha256: str, model_name: str,
                tokens: int, text: str) -> Path:
    """Write ``stats`` to ``path`` atomically: a temporary file in the same folder, renamed over ``path``.

    Args:
        path: the file to write (its folder is created).
        rope: the model's RoPE and shapes (the header records them).
        model_sha256, model_name: which model; tokens: calibration tokens; text: where the text came from.
    Returns:
        ``path``.
    Raises:
        OSError: the folder or file cannot be written (nothing is left at ``path``'s temporary name).
    """
    from safetensors.torch import save_file

    L, H, F = stats.shape
    meta = {"format": FORMAT, "version": VERSION, "model_sha256": model_sha256, "model": model_name,
            "rope_theta": repr(float(rope.theta)), "rope_scaling": json.dumps(rope.scaling, sort_keys=True),
            "head_dim": str(rope.head_dim), "n_layers": str(L), "n_heads": str(H), "n_kv_heads": str(rope.n_kv_heads),
            "tokens": str(tokens), "text": text}
    tensors = {"q_mean_real": stats.q_mean.real.float().contiguous(),
               "q_mean_imag": stats.q_mean.imag.float().contiguous(),
               "q_abs_mean": stats.q_abs_mean.float().contiguous(),
               "omega": stats.omega.to(torch.float64).contiguous()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_stats(path: Path, rope: RopeSpec) -> QueryStats:
    """The statistics in ``path``, checked against the model's RoPE and shapes.

    Raises:
        StatsFileError: no such file; not a readable statistics file of this format (corrupt, truncated, other
            tensors or shapes, non-finite values); or taken under another RoPE or shape than ``rope``'s (one line
            naming both).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise StatsFileError(f"{path}: no such TriAttention statistics file")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            t = {name: f.get_tensor(name) for name in ("q_mean_real", "q_mean_imag", "q_abs_mean", "omega")}
    except Exception as e:   # safetensors raises its own errors for a corrupt header or data, KeyError for a tensor
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise StatsFileError(f"{path}: not a readable TriAttention statistics file ({why})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise StatsFileError(f"{path}: not a zoomr TriAttention statistics file (format {meta.get('format')!r}, "
                             f"version {meta.get('version')!r}; zoomr calibrate writes {FORMAT!r} {VERSION})")
    try:
        theta = float(meta["rope_theta"])
        scaling = json.loads(meta["rope_scaling"])
        head_dim, n_kv_heads = int(meta["head_dim"]), int(meta["n_kv_heads"])
    except (KeyError, ValueError) as e:
        raise StatsFileError(f"{path}: its header lacks or garbles {e}") from None
    shape = t["q_mean_real"].shape
    if (len(shape) != 3 or t["q_mean_imag"].shape != shape or t["q_abs_mean"].shape != shape
            or tuple(t["omega"].shape) != (shape[2],)):
        raise StatsFileError(f"{path}: tensors of shapes {[tuple(x.shape) for x in t.values()]}, expected three "
                             "[layers, heads, head size / 2] and one [head size / 2]")
    if not all(torch.isfinite(x).all() for x in t.values()):
        raise StatsFileError(f"{path}: holds non-finite values")
    theirs = RopeSpec(theta, scaling or None, head_dim, shape[0], shape[1], n_kv_heads, t["omega"])
    if not rope_matches(theirs, rope):
        raise StatsFileError(f"{path} was calibrated for a RoPE and shape of {theirs.words()}; this model has "
                             f"{rope.words()} (calibrate it: zoomr calibrate -m MODEL)")
    q_mean = torch.complex(t["q_mean_real"].float(), t["q_mean_imag"].float())
    return QueryStats(q_mean, t["q_abs_mean"].float(), t["omega"].to(torch.float64))


def rope_matches(a: RopeSpec, b: RopeSpec) -> bool:
    """Same theta, scaling, head size and shapes, and inverse frequencies equal to :data:`OMEGA_RTOL`."""
    same = (math.isclose(a.theta, b.theta, rel_tol=1e-9) and (a.scaling or None) == (b.scaling or None)
            and (a.head_dim, a.n_layers, a.n_heads, a.n_kv_heads) == (b.head_dim, b.n_layers, b.n_heads, b.n_kv_heads)
            and a.omega.shape == b.omega.shape)
    return same and torch.allclose(a.omega.to(torch.float64), b.omega.to(torch.float64), rtol=OMEGA_RTOL, atol=0.0)


def query_stats(path: Path, name: str, rope: RopeSpec, calibrate: Callable[[], tuple[QueryStats, int, str]],
                stats_file: str | None = None, note: Callable[[str], None] | None = None) -> QueryStats:
    """A model's statistics: ``stats_file`` when given, else the cached ones, else calibrated now and cached.

    Args:
        path: the model's file or directory (hashed for the cache key); name: its display name.
        rope: the model's RoPE and shapes (every file read is checked against it).
        calibrate: computes them: ``(stats, tokens, text source)``; called only when nothing is cached.
        stats_file: a file to use instead of the cache (``--stats-file``); never calibrated over.
        note: where to say that a computed result could not be cached (default: stderr).
    Raises:
        StatsFileError: see :func:`read_stats` (a corrupt cached file included: ``zoomr calibrate`` rewrites it).
        ValueError, OSError: from ``calibrate`` (a model the torch backend cannot run) or hashing the model.
    """
    if stats_file is not None:
        return read_stats(Path(stats_file).expanduser(), rope)
    sha = model_sha256(path)
    cached = cached_path(sha)
    if cached.exists():
        try:
            return read_stats(cached, rope)
        except StatsFileError as e:
            raise StatsFileError(f"{e} [the cached file: rebuild it with zoomr calibrate -m {name}]") from None
    stats, tokens, text = calibrate()
    try:
        write_stats(cached, stats, rope, model_sha256=sha, model_name=name, tokens=tokens, text=text)
    except OSError as e:   # an unwritable cache only means calibrating again next time
        (note or _stderr)(f"zoomr: warning: TriAttention statistics not cached ({e})")
    return stats


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)
