"""Building a backend from :class:`RunOptions`: one place that knows every runtime."""

from __future__ import annotations

from typing import Callable

from zoomr.backends.base import Backend
from zoomr.backends.models import resolve_model

from zoomr.errors import UserError
from zoomr.options import POLICIES, RunOptions


def policy_spec(opts: RunOptions):
    """The :class:`zoomr.kvstore.registry.PolicySpec` of ``opts``' policy and knobs (not validated)."""
    from zoomr.kvstore.registry import PolicySpec

    return PolicySpec(opts.policy, opts.budget, opts.window, opts.topk_per_head, opts.consensus, opts.sink,
                      opts.summaries)


def torch_cache_factory(opts: RunOptions):
    """The torch backend's cache factory for ``opts.policy`` (None = plain full KV on the device).

    Raises:
        ValueError: bad policy knobs (checked here, before any model loads).
    """
    from zoomr.kvstore.registry import PolicyCacheFactory

    spec = policy_spec(opts)
    spec.build()
    # full stays the plain on-device cache; every other policy attends through the offloaded store
    return None if opts.policy == "full" else PolicyCacheFactory(spec)


def _torch(opts: RunOptions) -> Backend:
    from zoomr.backends.torch.engine import TorchBackend

    factory = torch_cache_factory(opts)
    device = "cpu" if opts.n_gpu_layers == 0 and opts.device == "auto" else opts.device
    return TorchBackend(resolve_model(opts.model), device=device, dtype=opts.dtype, n_ctx=opts.ctx_size,
                        threads=opts.threads, cache_factory=factory)


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
                           n_gpu_layers=opts.n_gpu_layers, policy=opts.policy, budget=opts.budget,
                           window=opts.window, sink=opts.sink, summaries=opts.summaries)


BACKENDS: dict[str, Callable[[RunOptions], Backend]] = {"torch": _torch, "llamacpp": _llamacpp}


def build_backend(opts: RunOptions) -> Backend:
    """The backend ``opts.backend`` names, with the model loaded.

    Raises:
        UserError: unknown backend name.
        backends.models.ModelNotFound, backends.torch.weights.ModelLoadError (ValueError): bad model.
    """
    if opts.backend not in BACKENDS:
        raise UserError(f"--backend {opts.backend!r} unknown (choose from {', '.join(BACKENDS)})")
    if opts.policy not in POLICIES:
        raise UserError(f"--policy {opts.policy!r} unknown (choose from {', '.join(POLICIES)})")
    check_lengths(opts)
    return BACKENDS[opts.backend](opts)


def check_lengths(opts: RunOptions) -> None:
    """``-c``, ``-n`` and ``-t`` make sense (checked before any model loads).

    Raises:
        UserError: ``-c`` under 16 tokens, ``-n`` 0 or below -1, ``-t`` below 1.
    """
    if opts.threads is not None and opts.threads < 1:
        raise UserError(f"-t must be >= 1, got {opts.threads}")
    if opts.ctx_size < 16:
        raise UserError(f"-c {opts.ctx_size} is too small (at least 16 tokens)")
    if opts.n_predict == 0 or opts.n_predict < -1:
        raise UserError(f"-n {opts.n_predict}: give a number of tokens >= 1, or -1 for no limit")
