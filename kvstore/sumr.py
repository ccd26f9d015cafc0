"""``sumr``: SumR, ZoomR's ablation that keeps summaries only and never zooms in.

Source: ZoomR paper §4 ("retains only the summary tokens and does not perform any detailed token
retrieval"). Here that is every closed segment's S_i, plus the prompt and the recent window; no
queries are scored, so the same rule works on a backend without attention scores (llama.cpp).
"""

from __future__ import annotations

from .segmented import SegmentedPolicy


class SumRPolicy(SegmentedPolicy):
    """Prompt + window + the summary of every closed segment (see :class:`SegmentedPolicy` for args)."""

    name = "sumr"

    def choose(self):
        return [], list(range(len(self.tracker.segments))), {}

    def describe(self) -> str:
        return f"sumr(window={self.window}, summaries={self.tracker.mode})"
