"""llama.cpp process setup and model loading through llama-cpp-python's low-level (ctypes) API.

Everything here is per process or per model file; contexts, batches and sequences live in
:mod:`zoomr.backends.llamacpp.engine`. Sources: llama.cpp ``include/llama.h`` as bound in
``llama_cpp/llama_cpp.py`` (llama-cpp-python ≥ 0.3.17).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from zoomr.backends.base import BackendError
from zoomr.backends.gguf_file import check_gguf
from zoomr.backends.llama_log import silence_llama_logs

# ggml_type ids (ggml.h) of the KV-cache element types this backend allocates, and their sizes.
GGML_TYPE_F16 = 1
KV_TYPE_BYTES = {GGML_TYPE_F16: 2}

_initialized = False


def init_llama() -> None:
    """Silence llama.cpp's C-level logs (kept with ZOOMR_DEBUG=1) and initialize its backends once."""
    global _initialized
    if _initialized:
        return
    import llama_cpp

    silence_llama_logs()
    llama_cpp.llama_backend_init()
    _initialized = True


@dataclass(frozen=True)
class ModelInfo:
    """Shapes of a loaded model that the engine needs.

    Attributes:
        n_layer: transformer layers.
        n_vocab: logit width (token ids).
        n_head_kv: KV heads per layer.
        head_dim_k, head_dim_v: per-head sizes of K and V (elements).
        n_ctx_train: context length the model was trained with (tokens).
        desc: llama.cpp's one-line description (architecture, size, quantization).
    """

    n_layer: int
    n_vocab: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    desc: str

    def kv_bytes_per_token(self, kv_type: int = GGML_TYPE_F16) -> int:
        """Bytes of K and V of one position over all layers: n_layer * n_head_kv * (d_k + d_v) * sizeof."""
        return self.n_layer * self.n_head_kv * (self.head_dim_k + self.head_dim_v) * KV_TYPE_BYTES[kv_type]


def _meta(model, key: str) -> str | None:
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def model_info(model) -> ModelInfo:
    """Read :class:`ModelInfo` from a ``llama_model*``.

    Head sizes come from ``{arch}.attention.key_length``/``value_length`` when the GGUF has them,
    else n_embd / n_head (llama.cpp's own default).
    """
    import ctypes

    import llama_cpp

    n_embd = llama_cpp.llama_model_n_embd(model)
    n_head = max(1, llama_cpp.llama_model_n_head(model))
    arch = _meta(model, "general.architecture") or "llama"
    dk = _meta(model, f"{arch}.attention.key_length")
    dv = _meta(model, f"{arch}.attention.value_length")
    desc = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, desc, len(desc))
    return ModelInfo(
        n_layer=llama_cpp.llama_model_n_layer(model),
        n_vocab=llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)),
        n_head_kv=llama_cpp.llama_model_n_head_kv(model),
        head_dim_k=int(dk) if dk else n_embd // n_head,
        head_dim_v=int(dv) if dv else n_embd // n_head,
        n_ctx_train=llama_cpp.llama_model_n_ctx_train(model),
        desc=desc.value.decode("utf-8", "replace"),
    )


def model_params(path: Path):
    """llama.cpp's default ``llama_model_params`` for ``path``, with its extra CPU buffer types (AMX, repacked
    layouts) turned off where :func:`zoomr.backends.llamacpp.amx_probe.extra_bufts_ok` finds they fault here."""
    import llama_cpp

    from .amx_probe import extra_bufts_ok

    params = llama_cpp.llama_model_default_params()
    if hasattr(params, "use_extra_bufts") and not extra_bufts_ok(path):
        params.use_extra_bufts = False
    return params


@contextlib.contextmanager
def llama_defaults(path: Path):
    """Within the block, llama-cpp-python's ``Llama(model_path=path)`` loads with :func:`model_params` (it reads
    ``llama_model_default_params`` when it loads and takes no option for the extra buffer types), so the
    benchmarks' and parity checks' reference llama.cpp runs where a plain ``Llama`` would fault."""
    import llama_cpp.llama_cpp as bindings

    params = model_params(path)
    original = bindings.llama_model_default_params

    def defaults():
        fresh = original()
        if hasattr(fresh, "use_extra_bufts"):
            fresh.use_extra_bufts = params.use_extra_bufts
        return fresh

    bindings.llama_model_default_params = defaults
    try:
        yield
    finally:
        bindings.llama_model_default_params = original


def load_model(path: Path, n_gpu_layers: int = -1):
    """Load a GGUF file with ``llama_model_load_from_file``; returns the ``llama_model*``.

    Args:
        path: GGUF file.
        n_gpu_layers: layers to offload (-1 = all); ignored by a CPU-only build of llama.cpp.
    Raises:
        zoomr.backends.models.ModelLoadError: the header or metadata fails
            :func:`zoomr.backends.gguf_file.check_gguf` (llama.cpp indexes some arrays unchecked and
            aborts the process on some bad values, so they are checked here first).
        ValueError: llama.cpp cannot load the file (unknown architecture, missing tensors).
    """
    import llama_cpp

    check_gguf(path)
    init_llama()
    params = model_params(path)
    params.n_gpu_layers = n_gpu_layers
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ValueError(f"{path}: llama.cpp cannot load this model (ZOOMR_DEBUG=1 shows llama.cpp's log)")
    return model


def new_context(model, kv_cells: int, n_batch: int, n_seq_max: int, unified: bool, threads: int, cb_eval=None):
    """A ``llama_context*`` over ``model`` with an f16 KV cache; returns (ctx, memory).

    Args:
        kv_cells: KV cells (``n_ctx``; tokens); llama.cpp rounds up to multiples of 256, per stream
            when not unified.
        n_batch: most tokens per ``llama_decode`` (also the micro-batch).
        n_seq_max: sequence ids the context accepts.
        unified: one cell pool shared by all ids (True) or one stream of ``kv_cells / n_seq_max`` per id.
        threads: CPU threads for decode and prefill.
        cb_eval: a ``ggml_backend_sched_eval_callback`` run on the graph's nodes (see
            :class:`zoomr.backends.llamacpp.capture.KQCapture`), or None.
    Raises:
        BackendError: llama.cpp cannot create the context (usually out of memory).
    """
    import llama_cpp

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = kv_cells
    params.n_batch = params.n_ubatch = n_batch
    params.n_seq_max = n_seq_max
    params.kv_unified = unified
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = GGML_TYPE_F16
    params.no_perf = True
    if cb_eval is not None:
        params.cb_eval = cb_eval
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise BackendError(f"llama.cpp cannot create a context of {kv_cells} KV cells and {n_seq_max} sequences "
                           "(out of memory?)")
    return ctx, llama_cpp.llama_get_memory(ctx)


def gpu_offload_supported() -> bool:
    """True when this llama.cpp build can put layers on a GPU (CUDA, Metal, Vulkan ...)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


def decode_error(rc: int, n_tokens: int, cells: int) -> BackendError:
    """The :class:`BackendError` for a non-zero ``llama_decode`` return code.

    Codes (llama.h): 1 no KV slot for the batch, 2 aborted by the abort callback, -1 invalid batch,
    < -1 fatal compute error.

    Args:
        rc: the return code.
        n_tokens: tokens in the failed batch.
        cells: KV cells of the context (tokens).
    """
    if rc == 1:
        return BackendError(f"llama.cpp found no free KV slot for {n_tokens} tokens: all {cells} KV cells of the "
                            "context are in use (free forked sequences, or build the backend with more kv_cells)")
    if rc == 2:
        return BackendError(f"llama_decode of {n_tokens} tokens was aborted by the abort callback")
    if rc == -1:
        return BackendError(f"llama.cpp rejected a batch of {n_tokens} tokens as invalid (return code -1)")
    return BackendError(f"llama_decode failed with return code {rc} on {n_tokens} tokens "
                        "(ZOOMR_DEBUG=1 shows llama.cpp's log)")
