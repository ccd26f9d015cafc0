"""What SumR and ZoomR share: segments, semantic-boundary recomputes, prompt + recent window.

Source: ZoomR paper §3.3–3.4 and Algorithm 1. The selection is

    I_f = I_p ∪ I_w ∪ ⋃_{i∈zoomed} R_i ∪ ⋃_{i∈summarized} S_i

where I_p is the prompt (the sequence's first forward, kept whole as the attention sink) and I_w the
last ``window`` generated positions. It is recomputed after a token whose text ends at a semantic
boundary, or once ``segment_tokens`` tokens have gone by without one
(:class:`zoomr.kvstore.segments.RecomputeClock`); in between, new tokens are appended to the active set and
attended. The segment still being written (and, in ``model`` mode, the regular
segment whose summary is being written) is kept whole beside the window, as the paper's I_w covers it
(§3.3: the recent window holds the tokens being reasoned over): a 250-token paragraph and its summary
must not lose their start to a 128-token window. In ``auto``/``prompted`` mode that part is at most
``segment_tokens`` long until the model writes a delimiter; while a summary is awaited it is at most
``SUMMARY_WAIT`` × ``segment_tokens`` (384 at 96), after which blocks are cut as in ``auto``
(:class:`zoomr.kvstore.segments.SegmentTracker`). So the active positions stay below
prompt + window + 2 × that bound + the regular parts of the zoomed segments + the summaries kept
(``tests/kv/test_summary_bound.py`` checks it on arbitrary streams).
Subclasses decide which segments are zoomed and which are summarized (:meth:`choose`).
"""

from __future__ import annotations

import abc

import torch

from .events import RecomputeEvent
from .policy import ForwardInfo, KVPolicy
from .segments import RecomputeClock, Segment, SegmentTracker

# SumR's and ZoomR's default --window (tokens) and where it comes from
WINDOW = 512
WINDOW_SOURCE = "ZoomR's analysis: 512 at 16K tokens; benchmarks/segment_sweep.py tried 128–512 at 2,048 tokens"
# the longest block of --summaries auto/prompted (tokens) and where it comes from
SEGMENT_TOKENS = 96
SEGMENT_SOURCE = "benchmarks/segment_sweep.py: 48, 96, 192 tried on the embedded model, MATH500"


class SegmentedPolicy(KVPolicy, abc.ABC):
    """Base of SumR and ZoomR.

    Args:
        window: w, recent generated positions always kept (tokens, ≥ 1).
        summaries: ``model``, ``prompted`` or ``auto`` (see :mod:`zoomr.kvstore.segments`).
        segment_tokens: the longest block in ``auto``/``prompted`` mode, and the most tokens between two
            recomputes in every mode (tokens, ≥ 1); blocks close at a
            paragraph end from a third of it (:func:`zoomr.kvstore.segments.default_min_segment`); a
            summary the model writes must close within ``SUMMARY_WAIT`` × it, else blocks are cut.
    Raises:
        ValueError: window < 1, segment_tokens < 1 or an unknown summaries mode.
    """

    needs_text = True  # segments close on the text written
    restores_evicted = True  # a segment left as its summary is zoomed in again when the votes pick it

    def __init__(self, window: int = WINDOW, summaries: str = "auto", segment_tokens: int = SEGMENT_TOKENS):
        if window < 1:
            raise ValueError(f"{self.name}: --window must be at least 1 token, got {window}")
        if segment_tokens < 1:
            raise ValueError(f"{self.name}: --segment-tokens must be at least 1 token, got {segment_tokens}")
        self.window = window
        self.tracker = SegmentTracker(summaries, max_segment=segment_tokens)
        self.n_prompt: int | None = None
        self.end = 0                       # positions written so far (prompt + generated)
        self.recomputes = 0
        self.clock = RecomputeClock(segment_tokens)

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """Track segments; at a semantic boundary, choose segments and return the new selection."""
        self.end = fwd.end
        if self.n_prompt is None:
            self.n_prompt = self.clock.last = fwd.end
            return None
        closed = self.tracker.push(fwd.start, fwd.text, len(fwd.token_ids))
        if closed:
            self.on_closed(closed)
        if not self.clock.due(fwd.text, fwd.end):
            return None
        recent = max(self.n_prompt, min(fwd.end - self.window, self.tracker.open_start))
        zoomed, summarized, votes = self.choose(recent)
        keep = set(range(self.n_prompt)) | set(range(recent, fwd.end))
        segs = self.tracker.segments
        for i in zoomed:
            keep.update(segs[i].regular)
        for i in summarized:
            keep.update(segs[i].summary)
        selection = torch.tensor(sorted(keep), dtype=torch.long)
        self.recomputes += 1
        ag = self.record(zoomed, votes)
        self.ctx.emit(RecomputeEvent(self.name, fwd.end - 1, zoomed, summarized, votes, ag, len(keep),
                                     len(segs), self.tracker.mode_ran()))
        return selection.expand(self.ctx.n_kv_heads, -1)

    def fork(self, ctx):
        """Shares the closed segments (see :meth:`SegmentTracker.copy`); copies the open segment's chunks."""
        other = self._fork_shallow(ctx)
        other.tracker = self.tracker.copy()
        other.clock = self.clock.copy()
        return other

    def on_closed(self, segments: list[Segment]) -> None:
        """Called with newly closed segments (before :meth:`choose`)."""

    @abc.abstractmethod
    def choose(self, recent: int) -> tuple[list[int], list[int], dict[int, int]]:
        """(zoomed segment indices, summarized segment indices, votes per voted segment): SumR summarizes
        every closed segment, ZoomR votes (each subclass is its paper's rule). ``recent`` is the first
        position of I_w (the window with the open segment, never before the prompt's end): everything from
        there on is attended whatever is chosen."""

    def record(self, zoomed: list[int], votes: dict[int, int]) -> float | None:
        """Book-keep one recompute; return its agreeability (None when not applicable)."""
        return None

    def stats(self) -> dict:
        """Recomputes and the tracker's counts (:meth:`zoomr.kvstore.segments.SegmentTracker.stats`)."""
        return {"recomputes": self.recomputes, **self.tracker.stats()}
