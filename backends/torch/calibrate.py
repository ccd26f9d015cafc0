"""TriAttention's calibration: one forward pass of the torch decoder over text, the pre-RoPE query statistics of
every layer and query head (:class:`zoomr.kvstore.triattention.QueryStats`), and their binding to policies.

The queries are read where attention reads them: a cache (:class:`QueryCapture`) sees every layer's rotated
queries (after a Qwen3 model's ``q_norm``), undoes their RoPE at their positions and sums, per frequency pair,
the complex query and its modulus, in float64. The text runs in chunks of :data:`CHUNK` tokens, each attending
all the text before it, so no chunk holds a [T, T] attention matrix of the whole text.

The text is zoomr's own source files as installed (:func:`calibration_text`): the reference's
``docs/calibration.md`` finds the statistics domain-agnostic ("calibrating on code and running math reasoning works
fine") and names a source file as a good choice, and these ship with every install, so calibration needs no
download and no data file of its own.

Source: ``scripts/calibrate.py`` of github WeianMao/triattention (one forward pass, per-head complex mean and mean
modulus of the pre-RoPE query, up to 32K tokens); see :mod:`zoomr.kvstore.triattention` for what differs.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from zoomr.backends.models import ModelSource
from zoomr.backends.query_stats import RopeSpec, query_stats
from zoomr.kvstore.base import FullKVCache
from zoomr.kvstore.triattention import QueryStats, complex_pairs, unrotate

DEFAULT_TOKENS = 2048    # means: 2,048 tokens give every head's q̄ within cosine 0.99 of 4,096's on the embedded model
MAX_TOKENS = 32768       # the reference's --max-length
MIN_TOKENS = 16
CHUNK = 512              # tokens per forward (tokens)
TEXT_PACKAGES = ("zoomr.kvstore", "zoomr.backends")
TEXT_SOURCE = "zoomr's source files (zoomr.kvstore, zoomr.backends)"

Progress = Callable[[int, int], None]


def calibration_text(min_chars: int = 0) -> str:
    """zoomr's installed Python sources of :data:`TEXT_PACKAGES`, files in sorted path order, joined by blank
    lines; only as many files as ``min_chars`` characters need (all: 0)."""
    parts, size = [], 0
    for pkg in TEXT_PACKAGES:
        root = Path(importlib.util.find_spec(pkg).submodule_search_locations[0])
        for f in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            parts.append(f.read_text(encoding="utf-8"))
            size += len(parts[-1]) + 2
            if min_chars and size >= min_chars:
                return "\n\n".join(parts)
    return "\n\n".join(parts)


class QueryCapture(FullKVCache):
    """Full KV that also sums each layer's pre-RoPE queries per head and frequency (float64).

    Args:
        n_layers, n_heads, n_kv_heads, head_dim: model shapes; device, dtype: the KV cache's.
        omega: [head_dim / 2] the model's RoPE inverse frequencies (to undo the rotation).
    """

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, omega: torch.Tensor):
        super().__init__(n_layers, n_kv_heads, head_dim, device, dtype)
        F = head_dim // 2
        self.omega = omega.to(device, torch.float64)
        self.sums = torch.zeros(n_layers, n_heads, F, dtype=torch.complex128, device=device)
        self.abs_sums = torch.zeros(n_layers, n_heads, F, dtype=torch.float64, device=device)
        self.counted = 0

    def update_parts(self, layer, q, k, v):
        """Sum ``q`` [H, T, d] (rotated, at positions n_tokens …) unrotated, then store K/V as full KV does."""
        T = q.shape[1]
        positions = torch.arange(self.n_tokens, self.n_tokens + T, device=q.device)
        pre = unrotate(complex_pairs(q.to(torch.float64), "half"), positions, self.omega)   # [H, T, F]
        self.sums[layer] += pre.sum(dim=1)
        self.abs_sums[layer] += pre.abs().sum(dim=1)
        if layer == 0:
            self.counted += T
        return super().update_parts(layer, q, k, v)

    def query_stats(self) -> QueryStats:
        """The means over the tokens seen so far: [L, H, F] complex64 and float32, on the CPU."""
        n = max(self.counted, 1)
        return QueryStats((self.sums / n).to(torch.complex64).cpu(), (self.abs_sums / n).float().cpu(),
                          self.omega.cpu())


def check_tokens(tokens: int) -> int:
    """``tokens`` itself when it is a calibration length :func:`calibrate` accepts.

    Raises:
        ValueError: outside [:data:`MIN_TOKENS`, :data:`MAX_TOKENS`] (naming ``--tokens``).
    """
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise ValueError(f"--tokens must be in [{MIN_TOKENS}, {MAX_TOKENS}] (tokens of calibration text), got {tokens}")
    return tokens


def calibrate(backend, tokens: int = DEFAULT_TOKENS, progress: Progress | None = None,
              ids: list[int] | None = None, chunk: int = CHUNK) -> tuple[QueryStats, int]:
    """The query statistics of ``backend``'s model over the first ``tokens`` tokens of :func:`calibration_text`.

    Args:
        backend: a loaded :class:`zoomr.backends.torch.engine.TorchBackend`.
        tokens: how many tokens of text (:data:`MIN_TOKENS` … :data:`MAX_TOKENS`).
        progress: called with (tokens done, tokens in all) after each chunk.
        ids: calibrate on these token ids instead (``tokens`` is then ignored).
        chunk: tokens per forward (each attends every token before it).
    Returns:
        (statistics [L, H, F], tokens used).
    Raises:
        ValueError: ``tokens`` out of range.
    """
    if ids is None:
        ids = backend.tokenizer.encode(calibration_text(min_chars=8 * check_tokens(tokens)))[:tokens]
    cfg, model = backend.cfg, backend.model
    cache = QueryCapture(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, backend.device, backend.kv_dtype,
                         model.rope.inv_freq)
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        t_ids = torch.tensor(part, dtype=torch.long, device=backend.device)
        pos = torch.arange(start, start + len(part), dtype=torch.long, device=backend.device)
        model.forward(t_ids, pos, cache)
        cache.end_forward(part, "")
        if progress is not None:
            progress(start + len(part), len(ids))
    return cache.query_stats(), len(ids)


def rope_spec(backend) -> RopeSpec:
    """The RoPE and shapes of a loaded torch backend's model (its own inverse frequencies)."""
    cfg = backend.cfg
    return RopeSpec(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                    backend.model.rope.inv_freq.to(torch.float64).cpu())


def gguf_rope_spec(path: Path) -> RopeSpec:
    """The RoPE and shapes of a GGUF file as the torch backend reads them (header and ``rope_freqs`` only, no
    weights): what llama.cpp rotates by too.

    Raises:
        ModelLoadError: a file the torch backend cannot read (see :func:`zoomr.backends.torch.weights.read_gguf_config`).
    """
    from zoomr.backends.gguf_file import check_gguf

    from .rope import inv_frequencies
    from .weights import read_gguf_config

    head = check_gguf(path)
    cfg = read_gguf_config(head)
    freqs = None
    info = next((t for t in head.tensors if t.name == "rope_freqs.weight"), None)
    if info is not None:
        import gguf

        raw = np.memmap(path, dtype=np.uint8, mode="r")[info.offset:info.offset + info.n_bytes]
        freqs = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, info.ggml_type), np.float32).reshape(-1))
    omega = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freqs)
    return RopeSpec(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, omega)


class ProgressLine:
    """The calibration's progress on stderr: one line saying what runs, kept up to date on a terminal
    (``\\r``), and its end with the time it took."""

    def __init__(self, name: str, tokens: int):
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.head = f"zoomr: triattention: calibrating query statistics of {name} on {tokens} tokens (once per model)"
        print(self.head + ("" if self.tty else " …"), end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            print(f"\r{self.head}: {done}/{total}", end="", file=sys.stderr, flush=True)

    def finish(self) -> None:
        took = time.perf_counter() - self.t0
        print(("\r" + self.head + ": " if self.tty else "zoomr: triattention: ") + f"calibrated in {took:.1f} s",
              file=sys.stderr, flush=True)


def calibrate_with_progress(backend, name: str, tokens: int = DEFAULT_TOKENS) -> tuple[QueryStats, int, str]:
    """:func:`calibrate` with a :class:`ProgressLine`; returns (statistics, tokens, text source) as
    :func:`zoomr.backends.query_stats.query_stats` wants them."""
    line = ProgressLine(name, check_tokens(tokens))
    stats, used = calibrate(backend, tokens, line)
    line.finish()
    return stats, used, TEXT_SOURCE


# one model's statistics, per statistics file asked for (None: the cache), for as long as its weights live: the
# views of one backend (bench's policies, KV-Rescue's helper) share its Decoder, and so these
_MEMO: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def backend_query_stats(backend, stats_file: str | None = None) -> QueryStats:
    """The statistics of a loaded torch backend's model: ``stats_file``'s, else cached, else calibrated now
    (with a progress line) and cached (:func:`zoomr.backends.query_stats.query_stats`).

    Raises:
        StatsFileError: a missing, corrupt or mismatched statistics file.
    """
    memo = _MEMO.setdefault(backend.model, {})
    if stats_file not in memo:
        source: ModelSource = backend.source
        memo[stats_file] = query_stats(source.path, source.name, rope_spec(backend),
                                       lambda: calibrate_with_progress(backend, source.name), stats_file)
    return memo[stats_file]


def bind_query_stats(backend, cache) -> None:
    """Give a new sequence's policy its statistics when it scores with them (TriAttention); the torch backend
    keeps keys in HF order, RoPE pairs (f, f + d/2). Anything else is left alone."""
    policy = getattr(cache, "policy", None)
    if getattr(policy, "needs_query_stats", False):
        policy.use_query_stats(backend_query_stats(backend, policy.stats_file), "half")


def calibration_backend(source: ModelSource, device: str = "auto", dtype: str = "auto", threads: int | None = None,
                        tokens: int = DEFAULT_TOKENS):
    """A torch backend of ``source`` for calibrating alone (``zoomr calibrate``; the llama.cpp backend's first use).

    With ``dtype`` auto a GGUF's blocks run in the int4 kernel (exact) in the CPU's faster half dtype: a calibration
    is one long prefill, which ``--quant auto``'s choice for one-row decode steps (ggml) ran 2.5× slower on the
    embedded model (1,024 tokens: 12.6 s against 4.9 s, one thread).

    Raises:
        ValueError: a model or option the torch backend refuses (ModelLoadError among them).
    """
    from .engine import TorchBackend, pick_device, pick_dtype

    if dtype == "auto" and source.kind == "gguf":
        dev = pick_device(device)
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(pick_dtype("auto", dev, "int4"), "auto")
    return TorchBackend(source, device=device, dtype=dtype, n_ctx=tokens, threads=threads)


def gguf_query_stats(source: ModelSource, stats_file: str | None = None) -> tuple[QueryStats, RopeSpec]:
    """The statistics of a GGUF model for the llama.cpp backend, calibrated by a torch backend on the same file when
    nothing is cached (loaded for that alone, then dropped).

    Raises:
        ValueError: the torch backend cannot read the model (it computes the statistics), naming why; a missing,
            corrupt or mismatched statistics file.
    """
    from zoomr.backends.models import ModelLoadError

    try:
        rope = gguf_rope_spec(source.path)
    except ModelLoadError as e:
        raise ValueError(f"--policy triattention needs query statistics from the torch backend, which cannot read "
                         f"this model: {e}") from None

    def run() -> tuple[QueryStats, int, str]:
        return calibrate_with_progress(calibration_backend(source), source.name)

    return query_stats(source.path, source.name, rope, run, stats_file), rope


def calibrate_to_file(backend, tokens: int = DEFAULT_TOKENS, out: Path | None = None) -> Path:
    """Calibrate ``backend``'s model now (with a progress line) and write the statistics: to ``out``, else to the
    model's cache entry (replacing it). Written atomically: a failure leaves nothing half-written.

    Raises:
        ValueError: ``tokens`` out of range.
        OSError: the file cannot be written.
    """
    from zoomr.backends.fingerprint import model_sha256
    from zoomr.backends.query_stats import cached_path, write_stats

    source: ModelSource = backend.source
    sha = model_sha256(source.path)
    stats, used, text = calibrate_with_progress(backend, source.name, tokens)
    _MEMO.pop(backend.model, None)   # a later sequence of this process reads what was just written
    return write_stats(Path(out).expanduser() if out is not None else cached_path(sha), stats, rope_spec(backend),
                       model_sha256=sha, model_name=source.name, tokens=used, text=text)
