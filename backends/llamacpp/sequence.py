"""A zoomr sequence on llama.cpp, and the two memory operations on its cells that zoomr's accounting rides on."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from zoomr.backends.base import BackendError, KVMeter

from .policies import CellPolicy


@dataclass(eq=False)
class LlamaCppSequence:
    """A zoomr sequence: one llama.cpp sequence id and what zoomr knows about its cells.

    Attributes:
        seq_id: llama.cpp sequence id; -1 once freed.
        policy: its eviction policy state.
        tokens: ids whose KV the sequence holds; ``tokens[i]`` is at position ``i`` (compact).
        origin: absolute position of each resident token (index in everything written).
        n_written: positions ever written (tokens).
        peak: most cells held at once, zoomr's accounting (tokens).
        peak_cells_llama: most cells held at once: llama.cpp's count (pos_max - pos_min + 1) when the policy
            shifts positions, zoomr's when evicted cells leave holes (that span is then checked, not a count).
        evictions, evicted_tokens: eviction bursts and tokens removed by them.
        meter: the sequence's KV accounting (means over decode calls, peaks; see
            :class:`zoomr.backends.base.KVMeter`); None until the engine attaches one.
        forwards: prefill/decode calls so far.
        store_id: a second llama.cpp sequence id holding every position (zoomr), else -1; ``seq_id`` is
            then the active one, holding the selection.
    """

    seq_id: int
    policy: CellPolicy
    tokens: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    n_written: int = 0
    peak: int = 0
    peak_cells_llama: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    meter: KVMeter | None = None
    forwards: int = 0
    store_id: int = -1

    @property
    def next_position(self) -> int:
        """The position the next token is written at: the cells held when eviction shifts (compact), else
        the positions ever written (holes stay)."""
        return len(self.tokens) if self.policy.shifts else self.n_written


def cells_held(mem, seq_id: int) -> int:
    """KV cells llama.cpp holds for ``seq_id``: ``pos_max - pos_min + 1`` (llama.h guarantees every
    position in between is present), 0 when empty."""
    import llama_cpp

    hi = llama_cpp.llama_memory_seq_pos_max(mem, seq_id)
    return 0 if hi < 0 else hi - llama_cpp.llama_memory_seq_pos_min(mem, seq_id) + 1


def remove_positions(mem, seq: LlamaCppSequence, ranges: list[tuple[int, int]]) -> None:
    """Evict absolute-position ranges of ``seq`` and close the gaps: ``llama_memory_seq_rm`` of each run of
    cells, then ``llama_memory_seq_add`` of the cells after it by minus its length, last run first so the
    positions of earlier runs stay valid. Keeps ``seq.tokens[i]`` at position ``i``.

    Args:
        mem: the context's ``llama_memory_t``.
        seq: the sequence; its cells must be its own (a stream), since a shift moves a shared cell for
            every sequence holding it.
        ranges: disjoint half-open ranges ``[p0, p1)`` of absolute positions; positions not resident are ignored.
    Raises:
        BackendError: llama.cpp refused a partial removal (recurrent memory).
    """
    import llama_cpp

    if not seq.policy.shifts:
        _remove_holes(mem, seq, ranges)
        return
    spans = []
    for p0, p1 in ranges:
        a, b = bisect.bisect_left(seq.origin, p0), bisect.bisect_left(seq.origin, p1)
        if a < b:
            spans.append((a, b))
    for a, b in sorted(spans, reverse=True):
        if not llama_cpp.llama_memory_seq_rm(mem, seq.seq_id, a, b):
            raise BackendError(f"llama.cpp refused to remove positions [{a}, {b}) of sequence {seq.seq_id}")
        llama_cpp.llama_memory_seq_add(mem, seq.seq_id, b, -1, a - b)
        del seq.tokens[a:b], seq.origin[a:b]
        seq.evicted_tokens += b - a
    if spans:
        seq.evictions += 1


def _remove_holes(mem, seq: LlamaCppSequence, ranges: list[tuple[int, int]]) -> None:
    """``llama_memory_seq_rm`` of each absolute range, positions kept (the cells after a hole are not moved)."""
    import llama_cpp

    removed = 0
    for p0, p1 in ranges:
        a, b = bisect.bisect_left(seq.origin, p0), bisect.bisect_left(seq.origin, p1)
        if a == b:
            continue
        if not llama_cpp.llama_memory_seq_rm(mem, seq.seq_id, p0, p1):
            raise BackendError(f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq.seq_id}")
        del seq.tokens[a:b], seq.origin[a:b]
        removed += b - a
    seq.evicted_tokens += removed
    if removed:
        seq.evictions += 1


def position_ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions → disjoint half-open runs ``[p0, p1)`` (what ``llama_memory_seq_rm``/``seq_cp`` take)."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
