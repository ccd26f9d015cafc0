"""``rkv``: R-KV — attention importance mixed with key redundancy, compressed every ``buffer`` tokens written.

Source: Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (github
Zefan-Cai/R-KV, rkv/compression/r1_kv.py, rkv/utils.py, and the schedule of rkv/modeling.py), re-derived here:

* importance: the last ``window`` (8) queries attend every key but the newest ``window``; with GQA the
  logits are max-pooled over the query heads of a KV group *before* the softmax; softmax over those
  keys, mean over the queries, then a max pool of width 7 (stride 1);
* redundancy: cosine similarity between the KV head's keys (all N, k / (‖k‖ + 1e-8)), diagonal zeroed;
  in each row i the entry of the newest key j with similarity > 0.5 is zeroed (row 0's entry when no
  key passes — the reference code's behaviour, kept); redundancy of key j = softmax over j of the
  column mean (``retain_direction="last"``; ``retain_ratio`` only acts in the ``*_percent`` directions, which
  the runs do not use); the newest ``window`` keys are dropped after the softmax;
* score = λ·importance − (1 − λ)·redundancy;
* each KV head keeps its top B − window keys plus the newest ``window``.

Schedule (:class:`zoomr.kvstore.schedule.BufferSchedule`): the prompt is never compressed; a decode step
compresses when the positions written before it reached a multiple of ``buffer`` (128) and at least B are
attended. After a 200-token prompt at B = 64 the whole prompt is attended until decode step 57 (256
written), which attends 257 positions; then the cache moves between B and B + buffer. So the most positions a
decode step attends is max(B + buffer, the first multiple of buffer ≥ P, + 1): :attr:`RKVPolicy.bound_tokens`.

Deviations from the reference, kept:

* λ = 0.1, the paper's and README's value (and the TriAttention authors' copy's default); run_math.py's
  default is 0.07.
* Scores are computed in float32 throughout; the reference casts the mean attention to the model's dtype
  (bf16) before the pool and the top-k (TriAttention's copy offers ``fp32_topk``, off by default), so near
  ties may break differently.
* The two schedule artifacts of the reference runner (a compressed prefill for the process's first problem
  only; a counter never reset between problems) are not reproduced: see :mod:`zoomr.kvstore.schedule`.
* On llama.cpp (one selection for every layer and head, :mod:`zoomr.backends.llamacpp.scored`) a prompt
  the cells cannot hold whole until its first compression is cut when the cells fill, and one longer than
  ``n_batch`` (512: prefilled in chunks, the later ones decode-phase forwards to the schedule) is compressed
  from its second chunk on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, grouped
from .schedule import WindowScheduledPolicy


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


class RKVPolicy(WindowScheduledPolicy):
    """R-KV compression, per layer and KV head.

    Args:
        budget: B, positions kept after a compression (tokens).
        window: queries observed = newest positions always kept (tokens; R-KV: 8).
        mix: λ (paper: 0.1).
        kernel: max-pool width (R-KV: 7).
        buffer: positions written between compressions (R-KV's ``divide_length``: 128).
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
        self.init_window(window, buffer)
        self.set_selection(selection)

    @property
    def bound_tokens(self) -> int:
        """The most positions a decode step attends (tokens): B + buffer, or, when the prompt is longer, the
        first compressing step's first multiple of buffer ≥ P, + 1 (before the prompt ran: B + buffer); at
        most the schedule's hard cap. Assumes one-token forwards after the prompt."""
        peak = max(self.budget + self.slack, self.schedule.first_peak())
        cap = self.schedule.hard_cap
        return peak if cap is None else min(peak, cap)

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Remember the queries; on the schedule's decode steps (or at its hard cap) compress to B."""
        held = self.queries.push(view)
        N, w = view.n_attended, self.window
        if held < w or not (self.schedule.over_cap(N) or (self.schedule.due(view) and N >= self.budget)):
            return None
        q, _ = self.queries.window(view.layer)
        pos, keys = view.positions, view.keys   # whole (a fork: concatenated) only to compress
        logits = torch.einsum("hgtd,hnd->hgtn", grouped(q, self.ctx.n_kv_heads), keys[:, :N - w].float())
        logits = logits.amax(dim=1) / keys.shape[-1] ** 0.5                  # [Hkv, W, N − w]
        importance = logits.softmax(dim=-1).mean(dim=1)
        importance = F.max_pool1d(importance[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        score = self.mix * importance - (1 - self.mix) * redundancy(keys)[:, :N - w]
        return self.choose(score, pos[:, :N - w], self.budget - w, pos[:, N - w:])

    def describe(self) -> str:
        return f"rkv(B={self.budget}, window={self.window}, λ={self.mix}, buffer={self.slack}{self.describe_selection()})"
