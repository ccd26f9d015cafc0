"""``keydiff``: KeyDiff — per KV head, keep the keys least like the others; no attention scores at all.

Source: Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364; kvpress ships it as ``KeyDiffPress``): each key is
scored by its cosine similarity to the anchor, the mean of the KV head's normalized keys, and the most similar
keys are evicted: a key far from the average direction is one few others can stand in for. The score reads
keys only, never a query or an attention matrix, so it runs beside fused attention kernels (SDPA, flash
attention, llama.cpp) that never form one. For long generation it is applied as R-KV and SnapKV are here:
whenever the attended set reaches ``B + buffer`` (buffer 128) the cache is cut to B, the newest ``window``
positions kept as they are and the rest chosen per KV head by the score.

Why KeyDiff and not TriAttention (issue 33 asked for one): TriAttention ranks keys by pre-RoPE query
statistics calibrated once per model, so every new model needs a calibration pass and its file; KeyDiff needs
nothing but the keys already in the cache, on any model. It runs on the torch backend: llama.cpp hands out
its keys only through an eval callback, not read yet (issue 33).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, ScoredPolicy


def key_diversity(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff's score per KV head: minus the cosine similarity of each key to the head's anchor.

    Args:
        keys: [Hkv, N, d] (post-RoPE, as cached).
    Returns:
        [Hkv, N] float32 in [-1, 1]; higher = less like the others = kept first.
    """
    unit = F.normalize(keys.float(), dim=-1)
    anchor = F.normalize(unit.mean(dim=1, keepdim=True), dim=-1)   # [Hkv, 1, d]
    return -(unit * anchor).sum(dim=-1)


@dataclass(frozen=True)
class KeyDiffConfig(PolicyConfig):
    """KeyDiff's knobs (tokens); ``1 ≤ window < budget``. The buffer (128) is fixed, as R-KV's."""

    budget: int = budget_knob()
    window: int | None = window_knob(None, "min(8, B / 2) (as R-KV's observation window)")
    selection: str | None = selection_knob()

    def build(self) -> "KeyDiffPolicy":
        return KeyDiffPolicy(self.budget, self.window, selection=self.selection)


class KeyDiffPolicy(ScoredPolicy):
    """Key-diversity eviction, per layer and KV head.

    Args:
        budget: B, positions kept after an eviction (tokens).
        window: the newest positions always kept (tokens); default min(8, B // 2).
        buffer: tokens appended between evictions (tokens; 128 as R-KV).
        selection: ``per-head`` (default) or ``shared`` (:class:`zoomr.kvstore.policy.ScoredPolicy`).
    Raises:
        ValueError: budget < 2, window outside [1, budget), buffer < 1, a bad selection.
    """

    name = "keydiff"

    def __init__(self, budget: int, window: int | None = None, buffer: int = 128, selection: str | None = None):
        if budget < 2:
            raise ValueError(f"keydiff: --budget must be at least 2 tokens, got {budget}")
        window = min(8, budget // 2) if window is None else window
        if not 1 <= window < budget:
            raise ValueError(f"keydiff: --window must be in [1, --budget {budget}), got {window}")
        if buffer < 1:
            raise ValueError(f"keydiff: buffer must be >= 1, got {buffer}")
        self.budget, self.window, self.slack = budget, window, buffer
        self.set_selection(selection)

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Cut to B once B + buffer positions are attended: the window plus the B − window most diverse keys."""
        N = view.n_attended
        if N < self.budget + self.slack:
            return None
        pos = view.positions   # whole (a fork: concatenated) only to evict
        score = key_diversity(view.keys)                                # [Hkv, N]: the anchor sees every key
        old = N - self.window
        return self.choose(score[:, :old], pos[:, :old], self.budget - self.window, pos[:, old:])

    def fork(self, ctx):
        """No state beyond the knobs: a fork is a shallow copy."""
        return self._fork_shallow(ctx)

    def describe(self) -> str:
        return f"keydiff(B={self.budget}, window={self.window}, buffer={self.slack}{self.describe_selection()})"
