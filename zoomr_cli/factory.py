"""Building a backend from :class:`RunOptions`: one place that knows every runtime."""

from __future__ import annotations

import os

from typing import Callable

from zoomr.backends.base import Backend
from zoomr.backends.models import resolve_model
from zoomr.kvstore.registry import REFERENCE, PolicyCacheFactory, PolicySpec, check_backend, knob_flags, policy_info

from zoomr.errors import UserError
from zoomr.options import RunOptions


def policy_spec(opts: RunOptions) -> PolicySpec:
    """``opts.policy`` with the knobs given that it has (not validated); the other knobs are other policies'."""
    return PolicySpec(opts.policy, **opts.policy_knobs())


def torch_cache_factory(opts: RunOptions):
    """The torch backend's cache factory for ``opts.policy`` (None = plain full KV on the device).

    Raises:
        ValueError: bad policy knobs (checked here, before any model loads).
    """
    check_backend(opts.policy, "torch")
    spec = policy_spec(opts)
    if opts.policy == REFERENCE:   # full stays the plain on-device cache (its knobs checked all the same)
        spec.build()
        return None
    # every other policy attends through the offloaded store; the factory builds the policy once, which both
    # validates the knobs and names it (no second build to check first)
    return PolicyCacheFactory(spec)


def check_policy(opts: RunOptions) -> None:
    """Build (and drop) ``opts.policy`` as ``opts.backend`` would, so bad knobs fail before any model loads.

    Raises:
        ValueError: a policy the backend cannot run, or knobs out of range.
    """
    opts.check_knobs()
    check_backend(opts.policy, opts.backend)
    if opts.backend == "llamacpp":
        from zoomr.backends.llamacpp.policies import make_policy

        make_policy(opts.policy, opts.ctx_size, **opts.policy_knobs())
    else:
        torch_cache_factory(opts)


def check_forks(opts: RunOptions) -> None:
    """``opts.policy`` can fork a sequence on ``opts.backend`` (KV-Rescue forks the base for its candidates).

    Raises:
        ValueError: the policy's own refusal (zoomr on llama.cpp: its store holds every position).
    """
    if opts.backend == "llamacpp":
        from zoomr.backends.llamacpp.policies import make_policy

        make_policy(opts.policy, opts.ctx_size, **opts.policy_knobs())().fork()


def _torch(opts: RunOptions) -> Backend:
    from zoomr.backends.torch.engine import TorchBackend

    factory = torch_cache_factory(opts)
    device = "cpu" if opts.n_gpu_layers == 0 and opts.device == "auto" else opts.device
    backend = TorchBackend(resolve_model(opts.model), device=device, dtype=opts.dtype, n_ctx=opts.ctx_size,
                           threads=opts.threads, cache_factory=factory, quant=opts.quant,
                           kv_dtype=opts.kv_dtype, compile=opts.compile)
    if getattr(policy_info(opts.policy).policy, "needs_query_stats", False):
        # TriAttention's statistics now, while the model loads: a first use calibrates them (a progress line),
        # which must not count in the first sequence's prefill time; a bad statistics file fails here
        from zoomr.backends.torch.calibrate import backend_query_stats

        backend_query_stats(backend, opts.policy_knobs().get("stats_file"))
    return backend


def with_policy(backend: Backend, opts: RunOptions) -> Backend:
    """A view of a loaded torch backend running ``opts.policy`` (weights shared, nothing reloaded).

    Raises:
        UserError: the backend is not the torch one (policies are compared there).
    """
    if backend.name != "torch":
        raise UserError("switching KV policies on a loaded model needs --backend torch")
    return backend.with_cache_factory(torch_cache_factory(opts))


def _llamacpp(opts: RunOptions) -> Backend:
    from zoomr.backends.llamacpp.engine import LlamaCppBackend

    return LlamaCppBackend(resolve_model(opts.model), n_ctx=opts.ctx_size, threads=opts.threads,
                           n_gpu_layers=opts.n_gpu_layers, policy=opts.policy, **opts.policy_knobs())


BACKENDS: dict[str, Callable[[RunOptions], Backend]] = {"torch": _torch, "llamacpp": _llamacpp}


def build_backend(opts: RunOptions) -> Backend:
    """The backend ``opts.backend`` names, with the model loaded (:func:`check_options` first).

    Raises:
        UserError / ValueError: see :func:`check_options`.
        backends.models.ModelNotFound, backends.torch.weights.ModelLoadError (ValueError): bad model.
    """
    check_options(opts)
    return BACKENDS[opts.backend](opts)


def check_options(opts: RunOptions) -> None:
    """Everything about ``opts`` that is known without the model, so a command can refuse bad flags before
    it says "loading model…".

    Raises:
        UserError: unknown backend, policy (or one the backend does not run), ``--dtype``, ``--quant`` or
            ``--kv-dtype``; a half ``--dtype`` with ``--quant fp16``/``w8a8``; ``-c``/``-n``/``-t``/``-ngl`` out of range
            (:func:`check_lengths`); a policy size not below ``-c`` (:func:`check_knob_sizes`); torch-only
            flags with ``--backend llamacpp``.
        ValueError: a policy knob out of range (whichever policy reads it), or knobs the policy rejects
            (:func:`check_policy`: e.g. ``--selection per-head`` on llama.cpp, ``--budget`` not above
            ``--window``).
    """
    if opts.backend not in BACKENDS:
        raise UserError(f"--backend {opts.backend!r} unknown (choose from {', '.join(BACKENDS)})")
    try:   # unknown, or one this backend cannot run (llama.cpp exposes no attention scores or queries)
        check_backend(opts.policy, opts.backend)
    except ValueError as e:
        raise UserError(str(e)) from None
    opts.check_knobs()
    check_lengths(opts)
    check_knob_sizes(opts)
    check_quant_option(opts)
    check_kv_dtype_option(opts)
    check_torch_placement(opts)
    if opts.backend == "llamacpp":   # its policy is built with the model; torch's factory is built first already
        check_policy(opts)   # the policy as llama.cpp builds it: its own range checks, before "loading model…"
    if opts.backend == "torch":
        import torch

        from zoomr.backends.torch.engine import DTYPES, pick_dtype
        from zoomr.backends.torch.quant import FP32_QUANT_MODES

        if opts.dtype != "auto" and opts.dtype not in DTYPES:
            raise UserError(f"--dtype {opts.dtype!r} unknown (choose from auto, {', '.join(DTYPES)})")
        if opts.quant in FP32_QUANT_MODES:
            try:
                pick_dtype(opts.dtype, torch.device("cpu"), opts.quant)
            except ValueError as e:
                raise UserError(str(e)) from None


def check_quant_option(opts: RunOptions) -> None:
    """``--quant`` names a mode, and one other than ``auto`` only on the torch backend (llama.cpp always runs
    the file's own quantization).

    Raises:
        UserError: an unknown mode, or ``--quant int8|int4|fp16|w8a8|none`` with ``--backend llamacpp``.
    """
    from zoomr.backends.torch.quant import check_quant

    try:
        check_quant(opts.quant)
    except ValueError as e:
        raise UserError(str(e)) from None
    if opts.quant != "auto" and opts.backend != "torch":
        raise UserError(f"--quant {opts.quant} applies to the torch backend (llama.cpp runs the file's own "
                        "quantization)")


def check_torch_placement(opts: RunOptions) -> None:
    """``--device`` and ``--dtype`` other than ``auto`` only on the torch backend: llama.cpp places layers with
    ``-ngl`` and computes in the file's own types, so there they would silently do nothing.

    Raises:
        UserError: ``--device``/``--dtype`` given with ``--backend llamacpp``.
    """
    if opts.backend == "torch":
        return
    if opts.device != "auto":
        raise UserError(f"--device {opts.device} applies to the torch backend (llama.cpp: -ngl 0 keeps every "
                        "layer on the CPU, -ngl N offloads N layers)")
    if opts.dtype != "auto":
        raise UserError(f"--dtype {opts.dtype} applies to the torch backend (llama.cpp computes in the file's own "
                        "types)")


def check_kv_dtype_option(opts: RunOptions) -> None:
    """``--kv-dtype`` names a dtype, and one other than ``auto`` only on the torch backend; so does ``--compile``.

    Raises:
        UserError: an unknown name, or a dtype given with ``--backend llamacpp`` (whose KV type is its own);
            ``--compile`` with ``--backend llamacpp``.
    """
    from zoomr.backends.torch.engine import check_kv_dtype

    try:
        check_kv_dtype(opts.kv_dtype)
    except ValueError as e:
        raise UserError(str(e)) from None
    if opts.kv_dtype != "auto" and opts.backend != "torch":
        raise UserError(f"--kv-dtype {opts.kv_dtype} applies to the torch backend")
    if opts.compile and opts.backend != "torch":
        raise UserError("--compile applies to the torch backend (llama.cpp runs its own kernels)")


# the most threads -t accepts: OpenMP (torch) and ggml crash outright far above any core count (-t 100000 was a
# segfault on both backends), and no CPU has more hardware threads than this
MAX_THREADS = 1024


def check_lengths(opts: RunOptions) -> None:
    """``-c``, ``-n`` and ``-t`` make sense (checked before any model loads).

    Raises:
        UserError: ``-c`` under 16 tokens, ``-n`` 0 or below -1, ``-t`` below 1 or above :data:`MAX_THREADS`,
            ``-ngl`` below -1.
    """
    if opts.n_gpu_layers < -1:
        raise UserError(f"-ngl {opts.n_gpu_layers}: give a number of layers >= 0, or -1 for all")
    if opts.threads is not None and opts.threads < 1:
        raise UserError(f"-t must be >= 1, got {opts.threads}")
    if opts.threads is not None and opts.threads > MAX_THREADS:
        raise UserError(f"-t {opts.threads}: at most {MAX_THREADS} threads (this machine has {os.cpu_count()} CPUs)")
    if opts.ctx_size < 16:
        raise UserError(f"-c {opts.ctx_size} is too small (at least 16 tokens)")
    if opts.n_predict == 0 or opts.n_predict < -1:
        raise UserError(f"-n {opts.n_predict}: give a number of tokens >= 1, or -1 for no limit")


def check_knob_sizes(opts: RunOptions) -> None:
    """Each policy size given in tokens (``--budget``, ``--window``, ``--sink``, ``--segment-tokens``) is below
    ``-c``: a policy keeping ``-c`` positions or more evicts nothing before the sequence stops at the context
    limit, so the run would be full KV under another name (llama.cpp's sumr refused it already; now both
    backends do, before any model loads).

    Raises:
        UserError: ``--budget 5000 is not below -c 4096 ...``.
    """
    flags = knob_flags()
    for name, value in opts.knobs.items():
        knob = flags.get(name)
        if knob is not None and knob.info.tokens and isinstance(value, int) and value >= opts.ctx_size:
            raise UserError(f"{knob.flag} {value} is not below -c {opts.ctx_size}: the policy would evict nothing "
                            f"before the context is full (raise -c or lower {knob.flag})")
