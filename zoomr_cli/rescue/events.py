"""The KV-Rescue events: everything the rescue loop does, as typed events, fanned out to subscribers.

One :class:`zoomr.kvstore.events.EventBus` (the bus KV policies emit into too) feeds the live view, the
``--json`` transcript and the tests, so what is shown, what is recorded and what is checked are the same
facts. Subscribers are called synchronously, in order, on the loop's thread; an event is never changed
after it is emitted. Every event here derives from :class:`zoomr.kvstore.events.Event`: ``kind`` names it
and ``as_dict()`` is its JSON form.

Terms: a *step* is one paragraph of reasoning (ends at ``\\n\\n``, EOS or the step-token limit);
a *candidate* is one sampled continuation for the current step from the ``base`` (evicted KV) or
the ``helper`` (full KV); the winner is *committed* to the shared trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from zoomr.kvstore.events import Event


@dataclass
class RunStarted(Event):
    """The loop starts: models, scorer and settings (a JSON-ready dict)."""

    kind: ClassVar[str] = "run_started"
    problem: str
    base: str
    helper: str
    scorer: str
    settings: dict
    prompt_tokens: dict  # role → prompt length in that model's tokens
    kv: dict = field(default_factory=dict)  # role → KVStats.as_dict() after the prompt's prefill


@dataclass
class CandidateStarted(Event):
    """Candidate ``cand`` (0-based within the step) of ``step`` starts sampling from ``source``."""

    kind: ClassVar[str] = "candidate_started"
    step: int
    cand: int
    source: str


@dataclass
class CandidateToken(Event):
    """One sampled token of a candidate, with the detector's readings after it.

    Attributes:
        token: id; text: the text it completed; n: tokens of the candidate so far.
        entropy: of the distribution it was sampled from (nats); mean_entropy: over the detector's window.
        gzip_ratio: of the compression window now.
        active_tokens, active_bytes, full_tokens, full_bytes: the candidate's KV when the token was
            sampled, i.e. at the forward its logits came from (``KVStats`` fields; tokens, bytes).
    """

    kind: ClassVar[str] = "token"
    step: int
    cand: int
    source: str
    token: int
    text: str
    n: int
    entropy: float
    mean_entropy: float
    gzip_ratio: float
    active_tokens: int = 0
    active_bytes: int = 0
    full_tokens: int = 0
    full_bytes: int = 0


@dataclass
class CandidateFinished(Event):
    """A candidate ended normally: ``stop_reason`` is ``stop`` (``\\n\\n``), ``eos``, ``length`` or ``context``."""

    kind: ClassVar[str] = "candidate_finished"
    step: int
    cand: int
    source: str
    stop_reason: str
    tokens: int
    text: str


@dataclass
class CandidateAborted(Event):
    """The degeneration detector stopped a base candidate mid-generation.

    Attributes:
        reason: ``entropy`` or ``repetition``; signals: the detector's values at the abort.
    """

    kind: ClassVar[str] = "candidate_aborted"
    step: int
    cand: int
    source: str
    reason: str
    tokens: int
    signals: dict
    text: str


@dataclass
class CandidateScored(Event):
    """The scorer's value for a surviving candidate (higher is better)."""

    kind: ClassVar[str] = "candidate_scored"
    step: int
    cand: int
    source: str
    score: float
    scorer: str


@dataclass
class StepCommitted(Event):
    """The best candidate became part of the trajectory.

    Attributes:
        tokens: the step's tokens in its source model (tokens).
        rebase: tokens each role prefilled to follow the commit ({"base": n, "helper": m}); the
            winner's own role prefills nothing (its fork became its state).
        final: the step ended the solution (EOS).
    """

    kind: ClassVar[str] = "step_committed"
    step: int
    cand: int
    source: str
    score: float
    text: str
    tokens: int
    candidates: int
    survivors: int
    rebase: dict
    final: bool


@dataclass
class KVSnapshot(Event):
    """KV statistics of one role's committed state after a re-base (``KVStats.as_dict()``)."""

    kind: ClassVar[str] = "kv"
    step: int
    role: str
    stats: dict


@dataclass
class RunFinished(Event):
    """The loop ended.

    Attributes:
        answer: the extracted final answer or None.
        stop_reason: ``eos``, ``max_steps``, ``context``, ``length`` (``max_new_tokens`` committed after the
            prompt), ``degenerate`` (every candidate of a step was
            aborted and there was no helper candidate) or ``interrupted`` (Ctrl-C).
        steps: committed steps; seconds: wall time of the loop (seconds).
    """

    kind: ClassVar[str] = "run_finished"
    answer: str | None
    stop_reason: str
    steps: int
    seconds: float

