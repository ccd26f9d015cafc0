"""Candidate scorers for KV-Rescue: one interface, a real PRM and a plainly named fallback.

KV-Rescue (arXiv:2608.15797, "Stepwise interleaving") commits the candidate step with the highest
process reward. A :class:`Scorer` gives one number per candidate (higher is better) from the
question, the committed steps and the candidate; any object with the attributes of :class:`Scorer`
fits. A scorer also says what it is (:meth:`Scorer.label`) and how much KV its own model held while
scoring, which KV-Rescue's memory accounting adds to the method's total (the paper's "Overhead
derivation": the helper's and the PRM's caches remain full).

* :class:`PRMScorer` — the paper's choice: a Qwen2.5-Math-PRM-style model on the torch backend,
  the reward of the candidate's step (P(correct) at its ``<extra_0>`` tag, in [0, 1]).
* :class:`HelperLikelihoodScorer` — when no PRM is given: the helper's mean log-likelihood of the
  candidate's tokens under the full committed context (nats/token, ≤ 0). Not a process reward; the
  output says so. It favours text the helper itself finds likely, so helper candidates get an edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from zoomr.rescue.engine import Candidate, Engine


@dataclass
class StepContext:
    """What a scorer may read for the current step.

    Attributes:
        question: the problem text.
        steps: committed step texts, in order.
        helper: the helper's committed state (full KV of question + steps).
    """

    question: str
    steps: list[str]
    helper: Engine


class Scorer(Protocol):
    """Scores surviving candidates.

    Attributes:
        name: shown in the output and recorded in the JSON.
        uses_helper: it scores with the helper's model and KV (then the helper is part of any method
            that uses this scorer, even one with no helper candidate).
        kv_peak_bytes: the most K/V bytes its own model (not the helper) held for one candidate since
            :meth:`reset_kv_peak` (bytes; 0 for a scorer without a model of its own).
    """

    name: str
    uses_helper: bool
    kv_peak_bytes: int

    def score(self, ctx: StepContext, cand: Candidate) -> float:
        """The candidate's score (higher is better). A scorer may also offer
        ``score_batch(ctx, cands) -> list[float]`` (same values, one batched forward); the batched loop
        uses it when present."""
        ...

    def label(self, helper_model: str) -> str:
        """``kind:model`` for records, e.g. ``prm:/models/prm-7b`` or ``likelihood:<helper_model>``."""
        ...

    def reset_kv_peak(self) -> None:
        """Start a new :attr:`kv_peak_bytes` measurement (e.g. per run)."""
        ...


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class HelperLikelihoodScorer:
    """Mean log p_helper(candidate tokens | question, committed steps) (nats per token).

    The helper's committed state is forked and the candidate's tokens (in the helper's vocabulary)
    prefilled with all logits; token i's log-probability comes from the logits before it (the
    committed state's next-token logits for i = 0). An empty step that ends the solution scores the
    helper's log-probability of ending there (its most likely end-of-sequence id).
    """

    name = "helper mean log-likelihood (fallback: no --prm given)"
    uses_helper = True
    kv_peak_bytes = 0  # its scoring fork is the helper's KV, counted with the helper

    def label(self, helper_model: str) -> str:
        return f"likelihood:{helper_model}"

    def reset_kv_peak(self) -> None:
        pass

    def score(self, ctx: StepContext, cand: Candidate) -> float:
        return self.score_batch(ctx, [cand])[0]

    def score_batch(self, ctx: StepContext, cands: list[Candidate]) -> list[float]:
        """:meth:`score` of each candidate; the non-empty ones prefilled together in one
        ``prefill_batch`` forward over scoring forks of the helper (one per candidate; on the torch backend
        they keep none of the scored tokens' K/V), freed after."""
        helper = ctx.helper
        ids = [helper.ids_of(c) for c in cands]
        out = [0.0] * len(cands)
        rows = [i for i, t in enumerate(ids) if t]
        for i, t in enumerate(ids):
            if not t:
                lp = _log_softmax(helper.next_logits)
                out[i] = float(max(lp[e] for e in helper.tokenizer.eos_ids if e < lp.shape[-1]))
        if not rows:
            return out
        seqs = []
        try:
            seqs = [helper.scoring_fork() for _ in rows]
            if len(rows) == 1:
                logits = [helper.backend.prefill(seqs[0], ids[rows[0]], all_logits=True)]   # [T, vocab]
            else:
                logits = helper.backend.prefill_batch(seqs, [ids[i] for i in rows], all_logits=True)
        finally:
            for seq in seqs:
                helper.release(seq)
        for i, lg in zip(rows, logits):
            before = np.concatenate([helper.next_logits[None], lg[:-1]])  # logits each token was drawn from
            out[i] = float(_log_softmax(before)[np.arange(len(ids[i])), ids[i]].mean())
        return out


class PRMScorer:
    """The reward of the candidate's step from a :class:`zoomr.backends.torch.prm.ProcessRewardModel`.

    Its KV per candidate is the PRM conversation up to the candidate's step tag, counted once (the
    prefix the PRM keeps between candidates plus the candidate's tokens; the copy made to fork the
    prefix is an implementation detail a batched PRM pass shares, as in the paper).
    """

    uses_helper = False

    def __init__(self, prm):
        self.prm = prm
        self.name = f"PRM {prm.source.name} (reward of the last step)"
        self.kv_peak_bytes = 0

    def label(self, helper_model: str) -> str:
        return f"prm:{self.prm.source.path}"

    def reset_kv_peak(self) -> None:
        self.kv_peak_bytes = 0

    def score(self, ctx: StepContext, cand: Candidate) -> float:
        return self.score_batch(ctx, [cand])[0]

    def score_batch(self, ctx: StepContext, cands: list[Candidate]) -> list[float]:
        """:meth:`score` of each candidate, all in one batched PRM forward over forks of the shared prefix."""
        rewards = self.prm.last_step_rewards(ctx.question, ctx.steps, [c.text for c in cands])
        self.kv_peak_bytes = max(self.kv_peak_bytes, self.prm.last_scored_tokens * self.prm.kv_token_bytes)
        return rewards


def build_scorer(prm_spec: str | None, device: str = "auto", dtype: str = "auto") -> Scorer:
    """``--prm MODEL`` → :class:`PRMScorer`; None → :class:`HelperLikelihoodScorer`.

    Raises:
        backends.models.ModelNotFound, backends.torch.weights.ModelLoadError (ValueError): a bad PRM.
    """
    if prm_spec is None:
        return HelperLikelihoodScorer()
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.prm import ProcessRewardModel

    return PRMScorer(ProcessRewardModel(resolve_model(prm_spec), device=device, dtype=dtype))
