"""The public API's constructors: a model loaded with a KV policy, a KV policy built by name.

Both go through what the CLI uses (:class:`zoomr.options.RunOptions` → :func:`zoomr.factory.build_backend`,
and the policy registry), so a name or knob means the same from Python as on the command line.
"""

from __future__ import annotations

import dataclasses

from zoomr.backends.base import Backend
from zoomr.factory import build_backend
from zoomr.kvstore.policy import KVPolicy
from zoomr.kvstore.registry import REFERENCE, REGISTRY, PolicySpec, knob_flags
from zoomr.options import RunOptions

# RunOptions fields that belong to one generation (zoomr.solve's arguments), not to the loaded model
_GENERATION = {"n_predict", "temp", "top_k", "top_p", "seed", "ignore_eos"}


def load(model: str | None = None, *, policy: str = REFERENCE, backend: str = "torch", **options) -> Backend:
    """Load a model with a KV policy (what ``zoomr solve -m MODEL --backend B --policy P ...`` loads).

    Args:
        model: ``-m``: None for the embedded SmolLM2-135M-Instruct, a ``.gguf`` path, a HF model
            directory, an alias of ``configs/models.toml`` or a hub id ``owner/name``.
        policy: one of :data:`zoomr.POLICIES` (on llama.cpp: ``policy_names("llamacpp")`` of
            :mod:`zoomr.kvstore.registry`).
        backend: ``torch`` (every policy) or ``llamacpp``.
        **options: the other model settings, named as :class:`zoomr.options.RunOptions` fields
            (``ctx_size`` in tokens, ``threads``, ``device``, ``dtype``, ``quant``, ``kv_dtype``, ``compile``,
            ``n_gpu_layers``), and the policy's knobs, named as its flags (``budget``, ``window``, ...: the
            policy table in docs/policies.md).
    Returns:
        a :class:`zoomr.backends.base.Backend` (prefill, decode, fork, free, kv_stats; pass it to
        :func:`zoomr.solve` or :func:`zoomr.run_rescue`).
    Raises:
        TypeError: an unknown option, a sampling option (those are :func:`zoomr.solve`'s), or a knob the
            policy does not have.
        zoomr.errors.UserError: an unknown backend or policy, ``ctx_size`` under 16 tokens.
        ValueError: a policy knob out of range; zoomr.backends.models.ModelNotFound and
            zoomr.backends.torch.weights.ModelLoadError (both ValueError): a bad model.
    """
    known = {f.name for f in dataclasses.fields(RunOptions)} - _GENERATION - {"model", "policy", "backend", "knobs"}
    knobs = {k: options.pop(k) for k in list(options) if k in knob_flags()}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"load() got unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))} and "
                        "the policy's knobs; sampling and n_predict go to zoomr.solve)")
    foreign = sorted(set(knobs) - set(REGISTRY[policy].knob_names)) if policy in REGISTRY else []
    if foreign:
        raise TypeError(f"load(): {policy} has no knob {foreign[0]!r} (its knobs: "
                        f"{', '.join(REGISTRY[policy].knob_names) or 'none'})")
    return build_backend(RunOptions(model=model, backend=backend, policy=policy, knobs=knobs, **options))


def make_policy(name: str, **knobs) -> KVPolicy:
    """A fresh KV policy (one per cache), to drive through :class:`zoomr.kvstore.cache.PolicyKVCache`.

    Args:
        name: one of :data:`zoomr.POLICIES`.
        **knobs: that policy's knobs (its config's fields: docs/policies.md's table gives each policy's, with
            defaults and their sources).
    Raises:
        TypeError: a knob the policy does not have.
        ValueError: an unknown name or a knob out of range.
    """
    return PolicySpec(name, **knobs).build()
