"""Running KV-Rescue over loaded models: the helper built beside the base, one loop run with its transcript.

:func:`run_rescue` is the entry point of the library (``zoomr.run_rescue``) and of ``zoomr solve --rescue``
(:mod:`zoomr.cli.rescue` loads the models and renders); :func:`rescue_once`, the loop over prompts already
tokenized, is what it and the bench cells share.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from zoomr.backends.base import Backend
from zoomr.backends.models import resolve_model
from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.factory import build_backend
from zoomr.kvstore.events import Event, EventBus
from zoomr.options import RunOptions
from zoomr.solving import solve_ids

from .loop import RescueConfig, RescueLoop
from .engine import Engine
from .scorers import HelperLikelihoodScorer, Scorer
from .transcript import Transcript

# candidate sampling of the KV-Rescue paper ("Implementation details"): T 0.8, top-p 0.95, top-k 20
PAPER_SAMPLING = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=0)


def helper_is_base(base, helper_opts: RunOptions) -> bool:
    """True when the helper is the base's own model on torch: :func:`build_helper` then loads nothing."""
    return helper_opts.backend == "torch" and getattr(base, "name", None) == "torch" and \
        resolve_model(helper_opts.model) == base.source


def build_helper(base, helper_opts: RunOptions):
    """The helper's backend (full KV). On torch, a helper that is the base's own model shares its weights
    (one copy in memory, no second load): only the KV cache factory differs."""
    if helper_is_base(base, helper_opts):
        return base.with_cache_factory(None)
    return build_backend(helper_opts)


def rescue_once(base, helper, scorer, sampler: Sampler, config: RescueConfig, question: str, base_ids: list[int],
                helper_ids: list[int], settings: dict | None = None, observers=(),
                stop_requested: Callable[[], bool] = lambda: False) -> tuple[str, Transcript]:
    """One KV-Rescue run over already built models; both committed states are freed afterwards.

    Args:
        base: evicting backend; helper: full-KV backend; scorer: see :mod:`zoomr.rescue.scorers`.
        base_ids, helper_ids: each model's prompt (tokens).
        observers: extra event subscribers (views), called after the transcript.
    Returns:
        (stop reason, the :class:`Transcript` of every event).
    Raises:
        UserError: a prompt of ``config.max_context`` tokens or more (:func:`zoomr.solving.check_fits`).
    """
    transcript = Transcript()
    events = EventBus(transcript, *observers)
    loop = RescueLoop(Engine("base", base), Engine("helper", helper), scorer, sampler, config, events,
                      stop_requested)
    try:
        reason = loop.run(question, base_ids, helper_ids, settings)
    finally:
        loop.close()
    return reason, transcript


def run_rescue(base: Backend, problem: str, *, helper: Backend | None = None, scorer: Scorer | None = None,
               config: RescueConfig | None = None, sampling: SamplingParams | None = None,
               system: str | None = None, on_event: Callable[[Event], None] | None = None,
               stop_requested: Callable[[], bool] = lambda: False, settings: dict | None = None) -> Transcript:
    """Solve ``problem`` with KV-Rescue: the evicting ``base`` and a full-KV ``helper`` propose each step,
    ``scorer`` commits the best (KV-Rescue, arXiv:2608.15797, "Stepwise interleaving").

    Args:
        base: the evicting model (``zoomr.load(policy="rkv", budget=...)``).
        helper: the full-KV model; None = the base's own weights with full KV (torch backend only).
        scorer: see :mod:`zoomr.rescue.scorers`; None = the helper's mean log-likelihood (a fallback,
            not a process reward).
        config: counts and limits (:class:`RescueConfig`); None = its defaults with ``max_context`` the
            smaller of the two models' ``n_ctx`` (tokens).
        sampling: candidate sampling; None = the paper's T 0.8, top-k 20, top-p 0.95, seed 0.
        system: a system message for both models' prompts; each model's prompt is the one :func:`zoomr.solve`
            would send it (:func:`zoomr.solving.solve_ids`: the summary instruction of ``summaries="prompted"``
            is added for a base under sumr/zoomr, never for the full-KV helper).
        on_event: called with every :class:`zoomr.rescue.events` event as it happens, on this thread, after
            the transcript took it (``event.kind``: ``candidate_started``, ``token``, ``candidate_aborted``,
            ``step_committed`` ...): the events ``record()`` lists, as objects.
        stop_requested: polled before every sampled token; True ends the run as Ctrl-C does.
        settings: more entries for the record's ``settings`` (``zoomr solve --rescue``: base_policy, budget,
            backend), after the config's fields and ``sampling``.
    Returns:
        the :class:`Transcript`: ``summary()`` (answer, stop_reason, steps, tokens, KV), ``record(problem)``
        (the ``--json`` document) and ``events``.
    Raises:
        UserError: a prompt of ``config.max_context`` tokens or more, or problem text that is not valid
            Unicode (:func:`zoomr.solving.solve_ids`, as :func:`zoomr.solve` checks it).
        ValueError: no helper given for a base that cannot share its weights, invalid counts or sampling values.
    """
    if helper is None:
        with_full_kv = getattr(base, "with_cache_factory", None)
        if with_full_kv is None:
            raise ValueError(f"run_rescue: give a helper (the {base.name} backend cannot share its weights)")
        helper = with_full_kv(None)
    config = (config or RescueConfig(max_context=min(base.n_ctx, helper.n_ctx))).validate()
    sampler = Sampler(sampling or PAPER_SAMPLING)
    base_ids = solve_ids(base, problem, system, config.max_context)
    helper_ids = solve_ids(helper, problem, system, config.max_context)
    settings = {"sampling": dataclasses.asdict(sampler.params), **(settings or {})}
    _, transcript = rescue_once(base, helper, scorer or HelperLikelihoodScorer(), sampler, config, problem,
                                base_ids, helper_ids, settings, observers=(on_event,) if on_event else (),
                                stop_requested=stop_requested)
    return transcript
