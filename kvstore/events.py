"""Events and the one bus that delivers them: KV-policy recomputes here, KV-Rescue's in :mod:`zoomr.rescue.events`.

Every event derives from :class:`Event` (a ``kind`` and a JSON-ready :meth:`Event.as_dict`), so one subscriber
(a live view, a ``--json`` transcript) can take events of both kinds. The bus lives in this, the lowest
layer, because a KV policy emits into it and kvstore may import nothing above itself (``tests/test_layers.py``);
rescue, a higher layer, uses the same :class:`EventBus`.

A policy that recomputes its selection (ZoomR, SumR) emits a :class:`RecomputeEvent`; a renderer
subscribes to the :class:`EventBus` of the backend's cache factory (:func:`kv_events`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, ClassVar, Generic, TypeVar


class Event:
    """Base of every event (subclasses are dataclasses); ``kind`` names it in JSON."""

    kind: ClassVar[str] = "event"

    def as_dict(self) -> dict:
        """JSON-ready dict: ``{"event": kind, **fields}`` (fields in declaration order, copied deeply)."""
        return {"event": self.kind, **asdict(self)}


E = TypeVar("E", bound=Event)


@dataclass
class RecomputeEvent(Event):
    """One recompute of the selection at a semantic boundary.

    Attributes:
        policy: policy name (``zoomr``, ``sumr``).
        position: position of the token after which the selection was recomputed (tokens).
        zoomed: indices i of the segments zoomed in (I_c: their regular segments R_i are attended).
        summaries: indices of the segments kept as summaries (I_s: their S_i are attended).
        votes: segment index → votes v_i (empty for SumR).
        agreeability: AG = Σ_{I_c} v_i / Σ_{I_all} v_j as ZoomR §4 defines it: over a vote of every summary,
            not only the candidates ``votes`` counts (:meth:`zoomr.kvstore.zoomr.ZoomRPolicy.record`); None
            when nothing was voted.
        active_tokens: positions attended at the next step, the new token excluded (tokens).
        segments: closed segments so far.
        summaries_mode: which segmentation produced them (see ``SegmentTracker.mode_ran``).
    """

    kind: ClassVar[str] = "recompute"
    policy: str
    position: int
    zoomed: list[int]
    summaries: list[int]
    votes: dict[int, int] = field(default_factory=dict)
    agreeability: float | None = None
    active_tokens: int = 0
    segments: int = 0
    summaries_mode: str = "none"

    def describe(self) -> str:
        """One short line for a live display."""
        ag = f" · AG {self.agreeability:.2f}" if self.agreeability is not None else ""
        return (f"{self.policy} @{self.position}: zoom in {_ids(self.zoomed)} · summaries {_ids(self.summaries)}"
                f"{ag} · {self.active_tokens} tok active · {self.segments} segment{'' if self.segments == 1 else 's'}"
                f" ({self.summaries_mode})")


def _ids(xs: list[int]) -> str:
    if len(xs) > 8:
        return "[" + ", ".join(map(str, xs[:8])) + f", … +{len(xs) - 8}]"
    return "[" + ", ".join(map(str, xs)) + "]"


class EventBus(Generic[E]):
    """Synchronous fan-out of events to subscribers: ``EventBus[RecomputeEvent]`` for a KV policy,
    ``EventBus[Event]`` for the rescue loop.

    Subscribers are called on the emitting thread, in subscription order; an event is never changed after it
    is emitted, and an exception a subscriber raises propagates to the emitter (later subscribers then miss
    that event).

    Args:
        subscribers: called with every event, in this order, before any subscribed later.
    """

    def __init__(self, *subscribers: Callable[[E], None]):
        self._subscribers: list[Callable[[E], None]] = list(subscribers)

    def subscribe(self, fn: Callable[[E], None]) -> None:
        """Call ``fn(event)`` for every event from now on."""
        self._subscribers.append(fn)

    def emit(self, event: E) -> None:
        """Deliver ``event`` to every subscriber, in subscription order."""
        for fn in self._subscribers:
            fn(event)


def kv_events(backend) -> EventBus[RecomputeEvent] | None:
    """The event bus of ``backend``'s KV policy: ``backend.kv_events`` or ``backend.cache_factory.events``;
    None when its policy emits no events (``full`` or a backend without one)."""
    bus = getattr(backend, "kv_events", None)
    if bus is None:
        bus = getattr(getattr(backend, "cache_factory", None), "events", None)
    return bus if isinstance(bus, EventBus) else None
