"""``sumr``: SumR, ZoomR's ablation that keeps summaries only and never zooms in.

Source: ZoomR paper §4 ("retains only the summary tokens and does not perform any detailed token
retrieval"). Here that is every closed segment's S_i, plus the prompt and the recent window; no
queries are scored, so the same rule works on a backend without attention scores (llama.cpp).

On both backends positions are never shifted: a dropped position leaves a hole and every kept key its
original rotation (the llama.cpp version, :mod:`zoomr.backends.llamacpp.sumr`, evicts with ``seq_rm`` only,
no ``seq_add``), so ``-c`` bounds the positions written on both. The llama.cpp version keeps no copy of what
it evicts, so its selection only shrinks, which SumR, never zooming in, does anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from .knobs import PolicyConfig, segment_tokens_knob, summaries_knob, window_knob
from .segmented import SEGMENT_SOURCE, SEGMENT_TOKENS, WINDOW, WINDOW_SOURCE, SegmentedPolicy


@dataclass(frozen=True)
class SumRConfig(PolicyConfig):
    """SumR's knobs; its active size follows from the segments (no budget)."""

    window: int = window_knob(WINDOW, WINDOW_SOURCE)
    summaries: str = summaries_knob()
    segment_tokens: int = segment_tokens_knob(SEGMENT_TOKENS, SEGMENT_SOURCE)

    def build(self) -> "SumRPolicy":
        return SumRPolicy(self.window, self.summaries, self.segment_tokens)


class SumRPolicy(SegmentedPolicy):
    """Prompt + window + the summary of every closed segment (see :class:`SegmentedPolicy` for args)."""

    name = "sumr"

    def choose(self, recent):
        return [], list(range(len(self.tracker.segments))), {}

    def describe(self) -> str:
        return f"sumr(window={self.window}, summaries={self.tracker.mode}{self.tracker.bounds_note()})"
