"""``rkv``: R-KV — attention importance mixed with key redundancy, compressed every ``buffer`` tokens.

Source: Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (github
Zefan-Cai/R-KV, rkv/compression/r1_kv.py and rkv/utils.py), re-derived here:

* importance: the last ``window`` (8) queries attend every key but the newest ``window``; with GQA the
  logits are max-pooled over the query heads of a KV group *before* the softmax; softmax over those
  keys, mean over the queries, then a max pool of width 7 (stride 1);
* redundancy: cosine similarity between the KV head's keys (all N, k / (‖k‖ + 1e-8)), diagonal zeroed;
  in each row i the entry of the newest key j with similarity > 0.5 is zeroed (row 0's entry when no
  key passes — the reference code's behaviour, kept); redundancy of key j = softmax over j of the
  column mean; the newest ``window`` keys are dropped after the softmax;
* score = λ·importance − (1 − λ)·redundancy with λ = 0.1 (paper; the code's default is 0.07);
* each KV head keeps its top B − window keys plus the newest ``window``.
Compression runs when B + buffer positions are attended, so the cache moves between B and B + buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, QueryWindow, ScoredPolicy, grouped


def redundancy(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """R-KV key redundancy per KV head.

    Args:
        keys: [Hkv, N, d].
    Returns:
        [Hkv, N] float32, each row a softmax (sums to 1).
    """
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(1, 2)
    N = sim.shape[-1]
    sim.diagonal(dim1=1, dim2=2).zero_()
    idx = torch.arange(N, device=sim.device).expand_as(sim)
    newest_dup = torch.where(sim > threshold, idx, torch.zeros_like(idx)).amax(dim=-1, keepdim=True)
    sim.scatter_(-1, newest_dup, 0.0)
    return sim.mean(dim=1).softmax(dim=-1)


@dataclass(frozen=True)
class RKVConfig(PolicyConfig):
    """R-KV's knobs (tokens); ``window < budget``. λ 0.1, pool width 7 and buffer 128 are fixed."""

    budget: int = budget_knob()
    window: int = window_knob(8, "R-KV", "observation window: the newest queries, "
                                     "always kept (tokens)")
    selection: str | None = selection_knob()

    def build(self) -> "RKVPolicy":
        return RKVPolicy(self.budget, self.window, selection=self.selection)


class RKVPolicy(ScoredPolicy):
    """R-KV compression, per layer and KV head.

    Args:
        budget: B, positions kept after a compression (tokens).
        window: queries observed = newest positions always kept (tokens; R-KV: 8).
        mix: λ (paper: 0.1).
        kernel: max-pool width (R-KV: 7).
        buffer: tokens appended between compressions (R-KV: 128).
        selection: ``per-head`` (default) or ``shared`` (:class:`zoomr.kvstore.policy.ScoredPolicy`).
    Raises:
        ValueError: budget ≤ window, window < 1, λ outside [0, 1], kernel even or < 1, buffer < window, a bad
            selection.
    """

    name = "rkv"

    def __init__(self, budget: int, window: int | None = None, mix: float = 0.1, kernel: int = 7,
                 buffer: int = 128, selection: str | None = None):
        window = 8 if window is None else window
        if window < 1 or budget <= window:
            raise ValueError(f"rkv: --budget {budget} must be larger than --window {window} (≥ 1)")
        if not 0.0 <= mix <= 1.0 or kernel < 1 or kernel % 2 == 0 or buffer < window:
            raise ValueError(f"rkv: need 0 ≤ λ ≤ 1, odd kernel ≥ 1, buffer ≥ window (got {mix}, {kernel}, {buffer})")
        self.budget, self.window, self.mix, self.kernel, self.slack = budget, window, mix, kernel, buffer
        self.queries = QueryWindow(window)
        self.set_selection(selection)

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Remember the queries; compress to B once B + buffer positions are attended."""
        held = self.queries.push(view)
        N, w = view.n_attended, self.window
        if N < self.budget + self.slack or held < w:
            return None
        q, _ = self.queries.window(view.layer)
        pos, keys = view.positions, view.keys   # whole (a fork: concatenated) only to compress
        logits = torch.einsum("hgtd,hnd->hgtn", grouped(q, self.ctx.n_kv_heads), keys[:, :N - w].float())
        logits = logits.amax(dim=1) / keys.shape[-1] ** 0.5                  # [Hkv, W, N − w]
        importance = logits.softmax(dim=-1).mean(dim=1)
        importance = F.max_pool1d(importance[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        score = self.mix * importance - (1 - self.mix) * redundancy(keys)[:, :N - w]
        return self.choose(score, pos[:, :N - w], self.budget - w, pos[:, N - w:])

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
        return f"rkv(B={self.budget}, window={self.window}, λ={self.mix}, buffer={self.slack}{self.describe_selection()})"
