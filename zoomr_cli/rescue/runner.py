"""Running KV-Rescue over loaded models: the helper built beside the base, one loop run with its transcript."""

from __future__ import annotations

from typing import Callable

from zoomr.backends.models import resolve_model
from zoomr.backends.sampling import Sampler
from zoomr.factory import build_backend
from zoomr.options import RunOptions

from .events import EventStream
from .loop import RescueConfig, RescueLoop
from .engine import Engine
from .transcript import Transcript


def build_helper(base, helper_opts: RunOptions):
    """The helper's backend (full KV). On torch, a helper that is the base's own model shares its weights
    (one copy in memory, no second load): only the KV cache factory differs."""
    if helper_opts.backend == "torch" and resolve_model(helper_opts.model) == base.source:
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
        ValueError: a prompt longer than ``config.max_context``.
    """
    events, transcript = EventStream(), Transcript()
    for sub in (transcript, *observers):
        events.subscribe(sub)
    loop = RescueLoop(Engine("base", base), Engine("helper", helper), scorer, sampler, config, events,
                      stop_requested)
    try:
        reason = loop.run(question, base_ids, helper_ids, settings)
    finally:
        loop.close()
    return reason, transcript
