"""``h2o``: Heavy-Hitter Oracle — accumulated attention heavy hitters plus a recent window.

Source: Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs"
(github FMInference/H2O): every cached token accumulates the attention it receives from every query
(softmax probabilities, causal); after each step a KV head keeps the ``recent`` newest tokens and the
``B − recent`` others with the largest accumulated score; evicted tokens never return. The paper's
split is 50/50 of the budget. With GQA, a KV head's score is the sum over its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, ScoredPolicy, grouped, received_attention

# positions a layer's score row gains at least when it grows (then an eighth of its length): doubling would
# leave up to half of the row unused, and the row is device memory the policy is charged for
SCORE_GROWTH = 256


@dataclass(frozen=True)
class H2OConfig(PolicyConfig):
    """H2O's knobs (tokens); ``1 ≤ window < budget``."""

    budget: int = budget_knob()
    window: int | None = window_knob(None, "B / 2 (H2O's 50/50 split)")
    selection: str | None = selection_knob()

    def build(self) -> "H2OPolicy":
        return H2OPolicy(self.budget, self.window, self.selection)


class H2OPolicy(ScoredPolicy):
    """Heavy hitters + recent window, per layer and KV head, re-selected after every forward.

    Args:
        budget: B, positions kept per KV head (tokens, ≥ 2).
        window: recent positions always kept (tokens); default B // 2; 1 ≤ window < B.
        selection: ``per-head`` (default) or ``shared`` (:class:`zoomr.kvstore.policy.ScoredPolicy`).
    Raises:
        ValueError: a budget, window or selection outside those ranges.
    """

    name = "h2o"

    def __init__(self, budget: int, window: int | None = None, selection: str | None = None):
        if budget < 2:
            raise ValueError(f"h2o: --budget must be at least 2 tokens (heavy hitters + recent), got {budget}")
        window = budget // 2 if window is None else window
        if not 1 <= window < budget:
            raise ValueError(f"h2o: --window must be in [1, --budget {budget}), got {window}")
        self.budget, self.window = budget, window
        self.slack = 1
        self.set_selection(selection)
        self.score: dict[int, torch.Tensor] = {}   # layer → [Hkv, capacity] float32 accumulated attention by position

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Accumulate this forward's attention; evict down to B when more is attended."""
        # scored part by part (a fork's shared prefix is read in place); positions concatenated only to select
        parts = view.position_parts
        q_pos = torch.arange(view.start, view.start + view.n_new, device=parts[0].device)
        received = received_attention(grouped(view.q, self.ctx.n_kv_heads), q_pos, view.key_parts, parts)  # [Hkv, N]
        acc = self._grow(view.layer, view.start + view.n_new, received.device)
        start = 0
        for p in parts:
            acc.scatter_add_(1, p, received[:, start:start + p.shape[1]])
            start += p.shape[1]
        N = start
        if N <= self.budget:
            return None
        pos = view.positions
        cand = pos[:, :N - self.window]
        return self.choose(acc.gather(1, cand), cand, self.budget - self.window, pos[:, N - self.window:])

    def _grow(self, layer: int, need: int, device: torch.device) -> torch.Tensor:
        acc = self.score.get(layer)
        if acc is None or acc.shape[1] < need:
            held = 0 if acc is None else acc.shape[1]
            # ≤ 1/8 unused (+ SCORE_GROWTH), at O(8) copies per position amortized
            grown = torch.zeros(self.ctx.n_kv_heads, max(need, held + max(SCORE_GROWTH, held // 8)),
                                device=device)
            if acc is not None:
                grown[:, :acc.shape[1]] = acc
            self.score[layer] = acc = grown
        return acc

    def state_tensors(self):
        """The accumulated scores: L × [Hkv, capacity] float32, capacity ≥ positions written (at most an
        eighth, or ``SCORE_GROWTH`` positions, more), i.e. 4·Hkv·L bytes per position: at head size 64 and
        fp32 K/V, N/(128·B) of the B attended positions' K/V."""
        return list(self.score.values())

    def fork(self, ctx):
        """Copies the accumulated scores (written in place every forward): L × [Hkv, capacity] float32,
        i.e. 4·Hkv bytes per position per layer, 1/(2·d) of the fp32 K/V it stands for (1/128 at
        head_dim 64). It is the one policy state that grows with the context."""
        other = self._fork_shallow(ctx)
        other.score = {layer: acc.clone() for layer, acc in self.score.items()}
        return other

    def describe(self) -> str:
        return f"h2o(B={self.budget}, heavy={self.budget - self.window}, recent={self.window}{self.describe_selection()})"
