"""KV policies the llama.cpp backend can run, expressed as cell eviction.

llama.cpp's memory API offers sequence operations on KV cells (``seq_rm``, ``seq_cp``, ``seq_add``)
and no attention scores. Policies that need only the tokens run on that alone: ``full`` (no
eviction), ``streaming`` (attention sinks + recent tokens, StreamingLLM) and ``sumr`` (prompt +
summaries + recent tokens, ZoomR's SumR ablation; see :mod:`zoomr.backends.llamacpp.sumr`). The
score-ranked ones (``h2o``, ``snapkv``, ``rkv``, ``keydiff``, ``triattention``) read each forward's queries and keys
through llama.cpp's eval callback and run the torch backend's scoring code, with one selection shared by every
layer and head (:mod:`zoomr.backends.llamacpp.scored`; TriAttention's statistics:
:mod:`zoomr.backends.llamacpp.triattention_cells`). ``zoomr`` keeps every position in a store sequence and
moves its selection in an active one (:mod:`zoomr.backends.llamacpp.zoomr_cells`). Which policies run here,
and what the others need, is the registry's (:mod:`zoomr.kvstore.registry`, ``backends`` and ``scores``); the
knobs and their defaults
are the policies' configs; asking for a policy that needs attention is a ``ValueError`` naming what
is supported.

A policy answers, for one sequence, which positions go and when. Positions are *absolute* (the
index of a token in everything the sequence ever wrote), so a policy never sees the engine's
position shifts. Evicted cells are gone for good (llama.cpp keeps no host copy), so a policy must
never drop a position it may want back; zoomr, which does, evicts nothing from its store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from zoomr.kvstore.events import EventBus
from zoomr.kvstore.full import FullConfig
from zoomr.kvstore.h2o import H2OConfig
from zoomr.kvstore.keydiff import KeyDiffConfig
from zoomr.kvstore.knobs import PolicyConfig
from zoomr.kvstore.registry import REFERENCE, PolicySpec, check_backend
from zoomr.kvstore.rkv import RKVConfig
from zoomr.kvstore.snapkv import SnapKVConfig
from zoomr.kvstore.streaming import StreamingConfig
from zoomr.kvstore.sumr import SumRConfig
from zoomr.kvstore.triattention import TriAttentionConfig
from zoomr.kvstore.zoomr import ZoomRConfig


class CellPolicy(Protocol):
    """Eviction policy of one llama.cpp sequence.

    Attributes:
        name: policy name as ``--policy`` spells it.
        cap: most KV cells the sequence may hold at any moment (tokens); the engine never lets
            llama.cpp write more, chunking a long prefill if needed.
        evicts: False when the policy never removes anything (the engine then refuses a forward
            that would not fit before running any of it).
        wants_text: True when :meth:`observe` needs the text of the tokens (detokenizing costs time).
        wants_kq: True when the engine must capture each forward's queries and keys and hand them over
            (``take_kq``, then ``observe`` for each prefill chunk) before :meth:`observe`.
        shifts: True when eviction closes the gap (``seq_add``: positions stay compact, keys re-rotated);
            False when evicted cells leave holes and every cell keeps its position.

    Optional (read with ``getattr``, default False / True): ``keeps_store`` — the sequence owns a second,
    store sequence id holding every position, and :meth:`observe` returning True means "call ``selection()``
    and make the active cells exactly those" (zoomr); ``observes_chunks`` — a prompt prefilled in chunks is
    observed chunk by chunk (False: once, after the last chunk).
    """

    name: str
    cap: int
    evicts: bool
    wants_text: bool
    wants_kq: bool
    shifts: bool

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """Record that absolute positions ``[start, start + len(ids))`` now hold ``ids`` (text ``text``,
        or "" when not wanted). Called once per prefill/decode call; True asks the engine to evict now."""
        ...

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """Positions to remove now, as disjoint half-open absolute ranges ``[p0, p1)``.

        Called when :meth:`observe` asked for it, or when the sequence holds ``cap`` cells and needs
        room. ``resident`` is the sorted list of absolute positions it holds. ``[]`` means
        "nothing may go" (at the cap, the engine then reports a full context).
        """
        ...

    def fork(self) -> "CellPolicy":
        """The policy state for a forked sequence (independent from here on)."""
        ...

    def describe(self) -> str:
        """Short text with the policy's parameters, for ``describe()``."""
        ...

    def stats(self) -> dict:
        """Policy counters for ``KVStats.extra`` (may be empty)."""
        ...

    def state_bytes(self) -> int:
        """Bytes the policy keeps on the compute device beside llama.cpp's KV cells (bytes), reported as
        ``policy_state_bytes`` as on the torch backend (:meth:`zoomr.kvstore.policy.KVPolicy.state_bytes`):
        0 for every policy here, which keep positions in host lists only."""
        ...


@dataclass(frozen=True)
class FullPolicy:
    """No eviction: the sequence holds up to ``cap`` = ``-c`` cells, then the context is full."""

    cap: int
    name: str = REFERENCE
    evicts: bool = False
    wants_text: bool = False
    wants_kq: bool = False
    shifts: bool = True

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """Nothing to record."""
        return False

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """Nothing is ever evicted."""
        return []

    def fork(self) -> "FullPolicy":
        """Stateless: the same object."""
        return self

    def describe(self) -> str:
        """``full``."""
        return self.name

    def stats(self) -> dict:
        """No counters."""
        return {}

    def state_bytes(self) -> int:
        """No state."""
        return 0


@dataclass(frozen=True)
class StreamingPolicy:
    """StreamingLLM: keep the ``sink`` first tokens and the ``window`` most recent ones.

    ``--budget``, ``--sink`` and ``--window`` mean what they mean on the torch backend
    (``zoomr.kvstore.streaming``): ``window`` defaults to ``budget - sink`` and ``sink + window ≤ budget``.
    Eviction runs in bursts: the sequence grows to ``sink + window + buffer`` cells, then drops back
    to ``sink + window`` in one ``seq_rm`` + ``seq_add``. Each shift makes llama.cpp re-rotate the
    cached keys, which costs about a quarter of the decode speed when done every token (measured on
    the embedded model: 31 vs 43 tok/s); a buffer of 16 pays it once per 16 tokens (45 tok/s). The
    R-KV pattern (compress every w tokens, cache between B and B + w). Attention at every step sees
    between ``sink + window + 1`` and ``sink + window + buffer`` cells.

    Args:
        budget: B (tokens), ≥ 1.
        sink: attention-sink tokens kept at the start (tokens), ≥ 0; StreamingLLM uses 4.
        window: recent tokens kept (tokens), ≥ 1.
        buffer: tokens admitted before the next eviction (tokens), ≥ 1.
    """

    budget: int
    sink: int
    window: int
    buffer: int
    name: str = "streaming"
    evicts: bool = True
    wants_text: bool = False
    wants_kq: bool = False
    shifts: bool = True

    @property
    def cap(self) -> int:
        """sink + window + buffer (tokens)."""
        return self.sink + self.window + self.buffer

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """Eviction waits for the cap."""
        return False

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """Everything between the sinks and the ``window`` most recent positions."""
        if len(resident) <= self.sink + self.window:
            return []
        return [(resident[self.sink], resident[len(resident) - self.window])]

    def fork(self) -> "StreamingPolicy":
        """Stateless: the same object."""
        return self

    def describe(self) -> str:
        """``streaming(B=…, sink=…, window=…, buffer=…)``."""
        return f"streaming(B={self.budget}, sink={self.sink}, window={self.window}, buffer={self.buffer})"

    def stats(self) -> dict:
        """No counters beyond the engine's eviction counts."""
        return {}

    def state_bytes(self) -> int:
        """No state."""
        return 0


STREAMING_BUFFER = 16  # tokens between evictions, see StreamingPolicy

Factory = Callable[[], CellPolicy]


def _full(config, n_ctx: int, buffer: int, events: EventBus | None) -> Factory:
    full = FullPolicy(n_ctx)
    return lambda: full


def _streaming(config, n_ctx: int, buffer: int, events: EventBus | None) -> Factory:
    from zoomr.kvstore.streaming import streaming_window

    budget, sink = config.budget, config.sink
    window = streaming_window(budget, sink, config.window)
    if buffer < 1:
        raise ValueError(f"streaming: the eviction buffer must be at least 1 token, got {buffer}")
    if sink + window + buffer > n_ctx:
        raise ValueError(f"streaming: --sink {sink} + --window {window} + {buffer} buffered tokens exceed -c {n_ctx}")
    streaming = StreamingPolicy(budget, sink, window, buffer)
    return lambda: streaming


def _sumr(config, n_ctx: int, buffer: int, events: EventBus | None) -> Factory:
    from .sumr import SumRCells

    SumRCells(n_ctx, config.window, config.summaries, segment_tokens=config.segment_tokens)  # validate now
    return lambda: SumRCells(n_ctx, config.window, config.summaries, events, config.segment_tokens)


def _scored(config, n_ctx: int, buffer: int, events: EventBus | None, cells: type | None = None) -> Factory:
    from .scored import PREFILL_ROOM, ScoredCells

    cells = cells or ScoredCells
    first = cells(config)   # validates the knobs now, before any model loads
    if first.bound > n_ctx:
        raise ValueError(f"{first.name}: --budget {config.budget} + {first.bound - config.budget} buffered tokens "
                         f"exceed -c {n_ctx}")
    room = max(1, min(PREFILL_ROOM, n_ctx - first.bound))   # cells need not outgrow the positions -c allows
    return lambda: cells(config, room)


def _triattention(config, n_ctx: int, buffer: int, events: EventBus | None) -> Factory:
    from .triattention_cells import TriAttentionCells

    return _scored(config, n_ctx, buffer, events, TriAttentionCells)


def _zoomr(config, n_ctx: int, buffer: int, events: EventBus | None) -> Factory:
    from .zoomr_cells import ZoomRCells

    ZoomRCells(config, n_ctx)   # validates the knobs now, before any model loads
    return lambda: ZoomRCells(config, n_ctx, events)


_zoomr.forks = False   # its store holds every position: a fork would copy it (ZoomRCells.fork refuses)


def can_fork(name: str) -> bool:
    """Whether a llama.cpp sequence under ``--policy name`` can fork (KV-Rescue forks its base for the
    candidates): every policy but zoomr.

    Raises:
        ValueError: an unknown policy.
    """
    return getattr(CELL_POLICIES.get(type(PolicySpec(name).config())), "forks", True)


# The llama.cpp implementation of each policy the registry lists for this backend, keyed by the policy's config
# class (the registry row's ``config``): the registry names policies and says which backends run them, this
# module only says how, so no policy name is spelled twice. tests/kv/test_registry.py checks that the two
# agree (kvstore may not import a backend, so the registry cannot hold these factories itself).
CELL_POLICIES: dict[type[PolicyConfig], Callable[..., Factory]] = {
    FullConfig: _full, StreamingConfig: _streaming, SumRConfig: _sumr,
    H2OConfig: _scored, SnapKVConfig: _scored, RKVConfig: _scored, KeyDiffConfig: _scored, ZoomRConfig: _zoomr,
    TriAttentionConfig: _triattention}


def make_policy(name: str, n_ctx: int, *, buffer: int = STREAMING_BUFFER, events: EventBus | None = None,
                **knobs) -> Factory:
    """A factory of per-sequence policies for ``--policy name``.

    Args:
        name: policy name, one the registry lists for llamacpp.
        n_ctx: most cells a sequence may hold (``-c``, tokens); an evicting policy must fit in it.
        buffer: streaming's tokens admitted between evictions (tokens).
        events: bus for sumr's recompute events (live display).
        knobs: the policy's knobs (its config's fields, e.g. streaming's ``budget``, ``sink``, ``window``:
            window None → budget − sink; sumr's ``window``, ``summaries``); the others keep its defaults.
    Raises:
        ValueError: an unsupported policy (the message names the supported ones and why), a knob the
            policy does not have, or parameters out of range or not fitting ``-c`` (one message each).
    """
    check_backend(name, "llamacpp")
    config = PolicySpec(name, **knobs).config()
    if type(config) not in CELL_POLICIES:
        raise ValueError(f"--policy {name}: registered for llamacpp, but {__name__} has no implementation of it")
    return CELL_POLICIES[type(config)](config, n_ctx, buffer, events)
