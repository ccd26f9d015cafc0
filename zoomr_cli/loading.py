"""The public API's constructors: a model loaded with a KV policy, a KV policy built by name.

Both go through what the CLI uses (:class:`zoomr.options.RunOptions` → :func:`zoomr.factory.build_backend`,
and the policy registry), so a name or knob means the same from Python as on the command line.
"""

from __future__ import annotations

import dataclasses

from zoomr.backends.base import Backend
from zoomr.factory import build_backend
from zoomr.kvstore.policy import KVPolicy
from zoomr.kvstore.registry import PolicySpec
from zoomr.options import RunOptions

# RunOptions fields that belong to one generation (zoomr.solve's arguments), not to the loaded model
_GENERATION = {"n_predict", "temp", "top_k", "top_p", "seed", "ignore_eos"}


def load(model: str | None = None, *, policy: str = "full", backend: str = "torch", **options) -> Backend:
    """Load a model with a KV policy (what ``zoomr solve -m MODEL --backend B --policy P ...`` loads).

    Args:
        model: ``-m``: None for the embedded SmolLM2-135M-Instruct, a ``.gguf`` path, a HF model
            directory, an alias of ``configs/models.toml`` or a hub id ``owner/name``.
        policy: one of :data:`zoomr.POLICIES` (the llama.cpp backend runs full, streaming and sumr).
        backend: ``torch`` (every policy) or ``llamacpp``.
        **options: the other model and policy settings, named as :class:`zoomr.options.RunOptions`
            fields: ``ctx_size`` (tokens), ``threads``, ``device``, ``dtype``, ``n_gpu_layers``,
            ``budget``, ``window``, ``sink``, ``topk_per_head``, ``consensus`` (tokens, counts),
            ``summaries``.
    Returns:
        a :class:`zoomr.backends.base.Backend` (prefill, decode, fork, free, kv_stats; pass it to
        :func:`zoomr.solve` or :func:`zoomr.run_rescue`).
    Raises:
        TypeError: an unknown option, or a sampling option (those are :func:`zoomr.solve`'s).
        zoomr.errors.UserError: an unknown backend or policy, ``ctx_size`` under 16 tokens.
        ValueError: a policy knob out of range; zoomr.backends.models.ModelNotFound and
            zoomr.backends.torch.weights.ModelLoadError (both ValueError): a bad model.
    """
    known = {f.name for f in dataclasses.fields(RunOptions)} - _GENERATION - {"model", "policy", "backend"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"load() got unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))}; "
                        "sampling and n_predict go to zoomr.solve)")
    return build_backend(RunOptions(model=model, backend=backend, policy=policy, **options))


def make_policy(name: str, **knobs) -> KVPolicy:
    """A fresh KV policy (one per cache), to drive through :class:`zoomr.kvstore.cache.PolicyKVCache`.

    Args:
        name: one of :data:`zoomr.POLICIES`.
        **knobs: that policy's settings (tokens): ``budget``, ``window``, ``sink``, ``topk_per_head``,
            ``consensus``, ``summaries`` (defaults and their sources: :mod:`zoomr.kvstore.registry`).
    Raises:
        TypeError: an unknown knob.
        ValueError: an unknown name or a knob out of range.
    """
    return PolicySpec(name, **knobs).build()
