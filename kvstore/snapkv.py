"""``snapkv``: SnapKV — observation-window attention, pooled, per KV head top-k plus the window.

Source: Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (github
FasterDecoding/SnapKV, snapkv_utils.py): the last ``window`` queries attend the cache (softmax over
all keys, causal); the attention each older key receives is summed over those queries, smoothed by
an average pool (kernel 5, stride 1, zero padding counted), and each KV head keeps its top
``B − window`` keys plus the window itself. SnapKV compresses the prompt once; for long generation it
is applied like R-KV, whenever the attended set reaches ``B + buffer`` (buffer 128), so the cache
moves between B and B + buffer. With GQA a KV head scores keys by the mean over its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, QueryWindow, ScoredPolicy, attention_probs, grouped


@dataclass(frozen=True)
class SnapKVConfig(PolicyConfig):
    """SnapKV's knobs (tokens); ``1 ≤ window < budget``. Pool width 5 and buffer 128 are fixed."""

    budget: int = budget_knob()
    window: int | None = window_knob(None, "min(32, B / 2) (SnapKV: 32)",
                                     "observation window: the newest queries, always kept (tokens)")
    selection: str | None = selection_knob()

    def build(self) -> "SnapKVPolicy":
        return SnapKVPolicy(self.budget, self.window, selection=self.selection)


class SnapKVPolicy(ScoredPolicy):
    """Observation-window compression, per layer and KV head.

    Args:
        budget: B, positions kept after a compression (tokens).
        window: observation window = recent positions always kept (tokens); default min(32, B // 2).
        kernel: average-pool width (SnapKV: 5).
        buffer: tokens appended between compressions (tokens; 128 as R-KV).
        selection: ``per-head`` (default) or ``shared`` (:class:`zoomr.kvstore.policy.ScoredPolicy`).
    Raises:
        ValueError: budget < 2, window outside [1, budget), kernel < 1 or even, buffer < 1, a bad selection.
    """

    name = "snapkv"

    def __init__(self, budget: int, window: int | None = None, kernel: int = 5, buffer: int = 128,
                 selection: str | None = None):
        if budget < 2:
            raise ValueError(f"snapkv: --budget must be at least 2 tokens, got {budget}")
        window = min(32, budget // 2) if window is None else window
        if not 1 <= window < budget:
            raise ValueError(f"snapkv: --window must be in [1, --budget {budget}), got {window}")
        if kernel < 1 or kernel % 2 == 0 or buffer < 1:
            raise ValueError(f"snapkv: kernel must be odd and >= 1 and buffer >= 1 (got {kernel}, {buffer})")
        self.budget, self.window, self.kernel, self.slack = budget, window, kernel, buffer
        self.queries = QueryWindow(window)
        self.set_selection(selection)

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Remember the queries; compress to B once B + buffer positions are attended."""
        self.queries.push(view)
        N = view.n_attended
        if N < self.budget + self.slack:
            return None
        q, q_pos = self.queries.window(view.layer)
        pos = view.positions   # whole (a fork: concatenated) only to compress
        probs = attention_probs(grouped(q, self.ctx.n_kv_heads), q_pos, view.keys, pos)  # [Hkv, G, W, N]
        votes = probs[..., :N - self.window].sum(dim=2).mean(dim=1)                      # [Hkv, N − window]
        pooled = F.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        cand = pos[:, :N - self.window]
        return self.choose(pooled, cand, self.budget - self.window, pos[:, N - self.window:])

    def state_tensors(self):
        """The observation window's queries: per layer up to ``window`` + one forward's [H, t, d], in the
        model's dtype."""
        return self.queries.tensors()

    def fork(self, ctx):
        """Shares the query window's tensors (replaced, never written): O(L) per fork."""
        other = self._fork_shallow(ctx)
        other.queries = self.queries.copy()
        return other

    def describe(self) -> str:
        return f"snapkv(B={self.budget}, window={self.window}, pool={self.kernel}, buffer={self.slack}{self.describe_selection()})"
