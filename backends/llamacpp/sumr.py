"""``sumr`` on llama.cpp: ZoomR's summaries-only ablation as segment-level cell eviction.

Source: ZoomR paper §4 (SumR "retains only the summary tokens and does not perform any detailed
token retrieval") and §3.3–3.4 (prompt kept whole, recent window, recompute at semantic
boundaries). Segments come from the backend-neutral tracker :mod:`zoomr.kvstore.segments` (delimited
summaries, or paragraph segments with an extractive stand-in when the model writes none).

Positions are never shifted: an evicted run of cells leaves a hole (``llama_memory_seq_rm`` only), every cell
keeps the position, and so the rotation, it was written at, and the next token goes at the positions written,
as on the torch backend (and as the score-ranked policies here, :mod:`zoomr.backends.llamacpp.scored`). So, as
there, ``-c`` bounds the positions written, i.e. the generation's length.

Otherwise the rule is the torch backend's SumR (``zoomr.kvstore.sumr``): the same segments, recomputes at the
same boundaries, the segment still being written kept whole beside the window (its summary is not known yet;
a summary must close within 4 × ``segment_tokens`` tokens, else the tracker cuts blocks as in ``auto``). The
one thing llama.cpp adds, keeping no copy of an evicted cell, is that a selection only shrinks: a closed
segment's regular tokens go at the first boundary after it closes and never return, which is exactly SumR
(it never zooms in) and why ZoomR runs differently here (:mod:`zoomr.backends.llamacpp.zoomr_cells`).
"""

from __future__ import annotations

import copy

from zoomr.kvstore.events import EventBus, RecomputeEvent
from zoomr.kvstore.segmented import SEGMENT_TOKENS
from zoomr.kvstore.segments import RecomputeClock, SegmentTracker


class SumRCells:
    """Prompt + the summary S_i of every closed segment + the ``window`` most recent generated tokens.

    The first :meth:`observe` of a sequence is its prompt. Later ones feed the segment tracker; when the
    text so far ends at a semantic boundary, or ``segment_tokens`` tokens went by without one
    (:class:`~zoomr.kvstore.segments.RecomputeClock`), the engine evicts every resident position outside the
    selection (one ``seq_rm`` per evicted run, leaving a hole). At the cap (``-c``) it evicts the same
    way, or reports a full context when nothing is evictable.

    Args:
        n_ctx: ``-c``, the most cells the sequence may hold (tokens).
        window: w, recent generated tokens always kept (tokens, 1 ≤ w < n_ctx).
        summaries: ``model``, ``prompted`` or ``auto`` (see :mod:`zoomr.kvstore.segments`).
        events: where a :class:`RecomputeEvent` goes at every recompute (live display), or None.
        segment_tokens: the longest block in ``auto``/``prompted`` mode and the most tokens between two
            evictions (tokens, ≥ 1), as on the torch backend.
    Raises:
        ValueError: window out of range, segment_tokens < 1 or an unknown summaries mode.
    """

    name = "sumr"
    evicts = True
    wants_text = True
    wants_kq = False
    shifts = False      # evicted cells leave holes; positions stay as written (as on torch)

    def __init__(self, n_ctx: int, window: int, summaries: str = "auto", events: EventBus | None = None,
                 segment_tokens: int = SEGMENT_TOKENS):
        if not 1 <= window < n_ctx:
            raise ValueError(f"sumr: --window {window} must be between 1 and {n_ctx - 1} tokens (below -c {n_ctx}); "
                             f"pass a smaller --window or a larger -c")
        self.cap = n_ctx
        self.window = window
        if segment_tokens < 1:
            raise ValueError(f"sumr: --segment-tokens must be at least 1 token, got {segment_tokens}")
        self.tracker = SegmentTracker(summaries, max_segment=segment_tokens)
        self.events = events
        self.n_prompt: int | None = None
        self.end = 0
        self.recomputes = 0
        self.clock = RecomputeClock(segment_tokens)

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """Record a forward; True (evict now) at a semantic boundary, or after ``segment_tokens`` tokens
        without one (:class:`zoomr.kvstore.segments.RecomputeClock`, as on the torch backend)."""
        self.end = start + len(ids)
        if self.n_prompt is None:
            self.n_prompt = self.clock.last = self.end
            return False
        self.tracker.push(start, text, len(ids))
        return self.clock.due(text, self.end)

    def _kept(self, p: int, summaries: set[int], recent: int) -> bool:
        return p < self.n_prompt or p >= recent or p in summaries

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """Runs of resident positions outside prompt ∪ summaries ∪ recent window ∪ open segment."""
        if self.n_prompt is None:
            return []
        segs = self.tracker.segments
        summaries = {p for s in segs for p in s.summary}
        open_start = self.tracker.open_start
        recent = max(self.n_prompt, self.end - self.window)
        if open_start is not None:
            recent = min(recent, open_start)
        runs, start, kept = [], None, 0
        for p in resident:
            if self._kept(p, summaries, recent):
                kept += 1
                if start is not None:
                    runs.append((start, p))
                    start = None
            elif start is None:
                start = p
        if start is not None:
            runs.append((start, resident[-1] + 1))
        self.recomputes += 1
        if self.events is not None:
            self.events.emit(RecomputeEvent(self.name, self.end - 1, [], list(range(len(segs))), {}, None, kept,
                                            len(segs), self.tracker.mode_ran()))
        return runs

    def fork(self) -> "SumRCells":
        """An independent copy (tracker included) reporting to the same event bus."""
        child = copy.copy(self)
        child.tracker = self.tracker.copy()
        child.clock = self.clock.copy()
        return child

    def describe(self) -> str:
        """``sumr(window=…, summaries=…, segments ≤ … tok)``, as on the torch backend."""
        return f"sumr(window={self.window}, summaries={self.tracker.mode}{self.tracker.bounds_note()})"

    def stats(self) -> dict:
        """Recomputes and the tracker's counts: segments, summaries written, blocks cut as in ``auto``,
        which segmentation ran and which was asked for (:meth:`zoomr.kvstore.segments.SegmentTracker.stats`)."""
        return {"recomputes": self.recomputes, **self.tracker.stats()}

    def state_bytes(self) -> int:
        """Nothing on the device: segments are host lists of positions (see ``CellPolicy.state_bytes``)."""
        return 0
