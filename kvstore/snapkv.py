"""``snapkv``: SnapKV — observation-window attention, pooled, per KV head top-k plus the window.

Source: Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (github
FasterDecoding/SnapKV, snapkv_utils.py): the last ``window`` queries attend the cache (softmax over
all keys, causal); the attention each older key receives is summed over those queries, smoothed by
an average pool (kernel 5, stride 1, zero padding counted), and each KV head keeps its top
``B − window`` keys plus the window itself. With GQA a KV head scores keys by the mean over its query heads.

When it compresses:

* the prompt, at the prefill, when it is longer than the budget (P > B): SnapKV's method, which compresses
  the prompt once and appends every decoded token;
* during decoding, on R-KV's schedule (:class:`zoomr.kvstore.schedule.BufferSchedule`), as R-KV's runner
  runs its SnapKV baseline for long generation (github Zefan-Cai/R-KV, rkv/compression/snapkv.py under
  rkv/modeling.py; README: "compressing every 128 generated tokens with the same budgets as R-KV"; the
  TriAttention authors' copy, triattention/methods/baselines/snapkv.py, runs the same way): a decode step
  compresses to B when the positions written before it reached a multiple of ``buffer`` (128) and at least B
  are attended. So a decode step attends at most B + buffer positions.

Deviations, kept: R-KV's SnapKV baseline scores as R-KV scores importance (window 8, logits max-pooled over
a KV group's query heads, softmax over the keys outside the window, max pool of 7); the scoring here is
SnapKV's own (window 32, average pool of 5, mean over query heads), and only the decode schedule is R-KV's.
R-KV's runner compresses the prompt of only the first problem a process runs (its flag starts as ``None``);
here every prompt longer than B is compressed, as SnapKV does. On llama.cpp a prompt prefilled in several
chunks (longer than ``n_batch``, 512) has its first chunk compressed as the prompt and the later ones on the
schedule (and whenever the cells fill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .knobs import PolicyConfig, budget_knob, selection_knob, window_knob
from .policy import LayerView, attention_probs, grouped
from .schedule import WindowScheduledPolicy


@dataclass(frozen=True)
class SnapKVConfig(PolicyConfig):
    """SnapKV's knobs (tokens); ``1 ≤ window < budget``. Pool width 5 and buffer 128 are fixed."""

    budget: int = budget_knob()
    window: int | None = window_knob(None, "min(32, B / 2) (SnapKV: 32)",
                                     "observation window: the newest queries, always kept (tokens)")
    selection: str | None = selection_knob()

    def build(self) -> "SnapKVPolicy":
        return SnapKVPolicy(self.budget, self.window, selection=self.selection)


class SnapKVPolicy(WindowScheduledPolicy):
    """Observation-window compression, per layer and KV head.

    Args:
        budget: B, positions kept after a compression (tokens).
        window: observation window = recent positions always kept (tokens); default min(32, B // 2).
        kernel: average-pool width (SnapKV: 5).
        buffer: positions written between decode-time compressions (tokens; 128, R-KV's schedule).
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
        self.init_window(window, buffer)
        self.set_selection(selection)

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Remember the queries; compress to B a prompt longer than B, and on the schedule's decode steps."""
        self.queries.push(view)
        N, sched = view.n_attended, self.schedule
        if sched.is_prompt(view):
            compress = N > self.budget
        else:
            compress = sched.due(view) and N >= self.budget
        if not (compress or sched.over_cap(N)):
            return None
        q, q_pos = self.queries.window(view.layer)
        pos = view.positions   # whole (a fork: concatenated) only to compress
        probs = attention_probs(grouped(q, self.ctx.n_kv_heads), q_pos, view.keys, pos)  # [Hkv, G, W, N]
        votes = probs[..., :N - self.window].sum(dim=2).mean(dim=1)                      # [Hkv, N − window]
        pooled = F.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        cand = pos[:, :N - self.window]
        return self.choose(pooled, cand, self.budget - self.window, pos[:, N - self.window:])

    def describe(self) -> str:
        return f"snapkv(B={self.budget}, window={self.window}, pool={self.kernel}, buffer={self.slack}{self.describe_selection()})"
