"""``--quant auto`` on a CPU: ggml's kernels or torch's int4 kernel, whichever decodes this model faster here.

Which is faster depends on the CPU: torch's int4 kernel computes in bf16, native on AVX512-BF16 and emulated on
AVX2, while ggml's products are integer dot products on every x86 CPU and its graphs fold a layer's norms, RoPE,
SwiGLU and residuals into two calls, a whole decode step over a plain full cache into one (:mod:`.ggml_layers`,
:mod:`.ggml_decode`). So it is measured, once per machine, on the model's own
first :data:`PROBE_LAYERS` layers and head (the same tensor types and shapes the full model runs): a
:data:`PROBE_CONTEXT`-token prompt, then decode steps of 1 row and of :data:`PROBE_BATCH` rows (what ``zoomr
bench -np`` and rescue's batched candidates run), best of a few, with those layers and without them; the
layers' share is scaled to the model's depth (a 30-layer model's head weighs less than 4 layers' worth of
steps suggests). The path with the faster estimated one-row decode wins;
both times are kept in ``quant_probe.json`` (:mod:`zoomr.backends.machine_cache`), keyed by CPU, torch and
llama-cpp-python versions, threads and the model's layer shapes and tensor types.

One path serves every row count of a loaded model: switching kernels by batch size would make a sequence's
tokens depend on how many others share its forward (the two paths round differently), which ``zoomr bench -np``
and rescue must not.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from zoomr.backends.machine_cache import cpu_name, lookup, store

CACHE_FILE = "quant_probe.json"
PROBE_VERSION = 4      # part of the cache key: a changed measurement does not read the old one's verdicts
PROBE_LAYERS = 4
PROBE_CONTEXT = 256
PROBE_BATCH = 8
_STEPS = 4
_REPS = 3


def _signature(path: Path) -> str:
    from zoomr.backends.gguf_file import check_gguf

    head = check_gguf(path)
    # layer 0's tensors and the global ones (embedding, head): types and shapes, layer prefix dropped
    return ",".join(sorted(f"{t.name.removeprefix('blk.0.')}:{t.ggml_type.name}:{'x'.join(map(str, t.shape))}"
                           for t in head.tensors if t.name.startswith("blk.0.") or not t.name.startswith("blk.")))


def _key(path: Path, threads: int) -> str:
    import llama_cpp

    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    return (f"probe {PROBE_VERSION}|{cpu_name()}|torch {torch.__version__}|{cap}|llama_cpp {llama_cpp.__version__}|"
            f"threads {threads}|{_signature(path)}")


def _step_ms(model, caches: list) -> float:
    """Best milliseconds of one decode step of ``len(caches)`` sequences continuing those caches."""
    rows, n = len(caches), caches[0].n_tokens
    best = float("inf")
    for rep in range(_REPS):
        t = time.perf_counter()
        for s in range(_STEPS):
            pos = n + rep * _STEPS + s
            model.forward_batch(torch.full((rows,), 7), torch.full((rows,), pos), [1] * rows, caches)
        best = min(best, (time.perf_counter() - t) / _STEPS)
    return best * 1e3


def _decode_ms(model, n_layers: int) -> dict[str, float]:
    """A full model's decode step (``n_layers`` layers) at 1 and PROBE_BATCH rows, estimated from the cut-down
    one: its step with every probe layer and with none (embedding and head alone), the layers' share scaled to
    ``n_layers``. Each sequence is a PROBE_CONTEXT-token prefill of its own, not a fork, as a user's sequences
    are: a plain full cache is what the ggml path decodes in one graph."""
    from zoomr.kvstore.base import FullKVCache

    cfg = model.cfg

    def prefilled() -> FullKVCache:
        cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.device, model.kv_dtype)
        model.forward(torch.arange(100, 100 + PROBE_CONTEXT) % cfg.vocab, torch.arange(PROBE_CONTEXT), cache)
        cache.end_forward([0] * PROBE_CONTEXT, "")
        return cache

    out = {}
    for rows in (1, PROBE_BATCH):
        with_layers = _step_ms(model, [prefilled() for _ in range(rows)])
        with model.first_layers(0):
            head_only = _step_ms(model, [prefilled() for _ in range(rows)])
        out[str(rows)] = round(head_only + max(with_layers - head_only, 0.0) * n_layers / len(model.layers), 3)
    return out


def measure(path: Path, half: torch.dtype) -> dict[str, dict[str, float]]:
    """Decode milliseconds per step of the whole model for each path, estimated from a cut-down one (its first
    PROBE_LAYERS layers and the real embedding and head; :func:`_decode_ms`).

    Args:
        path: the GGUF file; half: the compute dtype the int4 path would run (``--dtype auto``'s pick).
    Returns:
        {"ggml": {"1": ms, "8": ms}, "int4": {...}}; a path that fails to build or run is left out.
    """
    from zoomr.backends.gguf_file import check_gguf

    from .model import Decoder
    from .weights import load_gguf, read_gguf_config

    out = {}
    for name, quant, dtype, kw in (("ggml", "ggml", torch.float32, {"raw": True}),
                                   ("int4", "auto", half, {"keep_blocks": True})):
        try:
            depth = read_gguf_config(check_gguf(path)).n_layers
            cfg, tensors, _ = load_gguf(path, layers=PROBE_LAYERS, **kw)
            model = Decoder(cfg, tensors, torch.device("cpu"), dtype, quant=quant)
            del tensors
            out[name] = _decode_ms(model, depth)
        except (OSError, RuntimeError, ValueError):
            continue   # the path cannot run here: the other one is chosen
    return out


def pick(path: Path, half: torch.dtype) -> tuple[str, dict]:
    """``ggml`` or ``auto`` (int4 blocks in ``half``) for ``--quant auto`` on this CPU and model: cached, else
    measured (a few seconds) and cached. An unwritable cache only means measuring again next time.

    Returns:
        (mode, the probe's entry: {"quant", "ms": {path: {rows: ms}}}).
    """
    key = _key(path, torch.get_num_threads())
    hit = lookup(CACHE_FILE, key)
    if hit is not None and hit.get("quant") in ("ggml", "auto"):
        return hit["quant"], hit
    ms = measure(path, half)
    if "ggml" in ms and ("int4" not in ms or ms["ggml"]["1"] <= ms["int4"]["1"]):
        mode = "ggml"
    else:
        mode = "auto"
    entry = {"quant": mode, "ms": ms}
    store(CACHE_FILE, key, entry)
    return mode, entry


def reason(entry: dict) -> str:
    """Why the probe chose as it did, for the model line (the two estimated one-row step times)."""
    ms = entry.get("ms", {})
    if "ggml" in ms and "int4" in ms:
        return (f"one-row decode step, estimated from {PROBE_LAYERS} layers: ggml {ms['ggml']['1']:.1f} vs int4 "
                f"{ms['int4']['1']:.1f} ms")
    return "the only path that ran here"
