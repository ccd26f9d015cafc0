"""``zoomr``: ZoomR multi-granularity KV retrieval.

Source: ZoomR paper §3.3 and Algorithm 1.

* Mean summary key per (layer l, KV head h): k̄_i = mean of the post-RoPE keys of S_i (of all of R_i
  for paragraph segments, which have no written summary); kept on the compute device.
* Scoring: α_i = q_t · k̄_i for every query head, q_t the query of the token just processed; with GQA a
  query head uses its KV group's k̄.
* Candidates: the closed segments that start before the recent window I_w (the window with the
  segment still being written). A segment wholly inside I_w is attended in full whatever the votes say,
  so zooming it in would spend one of the c slots on nothing: §3.5's MS counts the c zoomed paragraphs
  (c·L̄_R) on top of N_w, i.e. outside the window. Counting them, the most-voted segments on the
  embedded model were the newest ones, already in the window: at 2,048 generated tokens and --window 384,
  c = 2 and c = 0 kept the same mean active KV and the same KL to full KV (benchmarks/segment_sweep.py
  --consensus 2,0), so the votes retrieved nothing.
* Voting: every (layer, query head) votes for its top-k candidates (k = 2; all of them when fewer);
  v_i = votes of segment i, I_all = {i : v_i > 0}.
* Consensus: I_c = the c most-voted (c = 2; ties: the newer segment first), I_s = I_all \\ I_c.
* Context: prompt ∪ window ∪ R_i for i ∈ I_c ∪ S_i for i ∈ I_s (see :mod:`zoomr.kvstore.segmented`).
* Agreeability AG = Σ_{i∈I_c} v_i / Σ_{j∈I_all} v_j as §4 defines it, recorded at every recompute: the votes
  of every (layer, query head) over *all* N_t summaries (Algorithm 1, line 14: arg top-k over i ∈ 1..N_t),
  I_c their c most-voted (:attr:`ZoomRPolicy.ag`, ``stats()["ag_mean"]``, ``ag_std``, ``ag_recomputes``; the
  recompute event's ``agreeability``). That vote is a diagnostic beside the selection's: the selection votes
  over the candidates only (above), so its own AG differs. Zoomr's own AG is kept beside it
  (:attr:`ZoomRPolicy.ag_candidates`, ``ag_candidates_mean`` / ``_std`` / ``_recomputes``): the selection's
  votes, at the recomputes with more than max(c, k) candidates (with at most k every head votes for all of
  them, so that AG = min(c, C) / C whatever the queries, and those recomputes only pull the mean up and the
  spread down). The paper's AG keeps them all, so it is 1 while N_t ≤ c and reads high early in a run.
* Memory saving MS of §3.5 (:func:`memory_saving_formula`), evaluated on the run's own N_p, N_g, L̄_R,
  L̄_S, |I_all| and N_w, is reported beside the measured saving (``stats()["saving_formula"]``).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

import torch

from .knobs import PolicyConfig, knob, segment_tokens_knob, summaries_knob, window_knob
from .policy import LayerView
from .segmented import SEGMENT_SOURCE, SEGMENT_TOKENS, WINDOW, WINDOW_SOURCE, SegmentedPolicy
from .segments import Segment


def memory_saving_formula(n_prompt: int, n_generated: int, consensus: int, mean_regular: float,
                          mean_summary: float, n_voted: int, window: int) -> float:
    """ZoomR §3.5: MS = (N_p + N_g) / (N_p + c·L̄_R + (|I_all| − c)·L̄_S + N_w).

    Args:
        n_prompt: N_p, prompt tokens. n_generated: N_g, generated tokens.
        consensus: c, segments zoomed in. mean_regular: L̄_R, mean regular-segment length (tokens).
        mean_summary: L̄_S, mean summary (or stand-in) length (tokens). n_voted: |I_all|, segments voted
            for. window: N_w, the recent window (tokens).
    Returns:
        full KV tokens / selected tokens (×). Fewer voted segments than c zoom in only |I_all| of them,
        so c is taken as min(c, |I_all|) (the paper's formula assumes |I_all| ≥ c).
    Raises:
        ValueError: a negative count, or a zero denominator.
    The paper's example: (512, 16384, 2, 250, 20, 80, 512) → 5.48×.
    """
    if min(n_prompt, n_generated, consensus, mean_regular, mean_summary, n_voted, window) < 0:
        raise ValueError("memory_saving_formula: counts and lengths must be >= 0")
    zoomed = min(consensus, n_voted)
    selected = n_prompt + zoomed * mean_regular + (n_voted - zoomed) * mean_summary + window
    if selected <= 0:
        raise ValueError("memory_saving_formula: nothing is selected (zero denominator)")
    return (n_prompt + n_generated) / selected


def _count_top(alpha: torch.Tensor, k: int) -> torch.Tensor:
    """v_i: how many (layer, query head) rows of ``alpha`` [L, H, S] hold segment i among their top-k
    (min(k, S)); [S] int64 on the CPU."""
    S = alpha.shape[-1]
    top = alpha.topk(min(k, S), dim=-1).indices
    return torch.bincount(top.flatten(), minlength=S).cpu()


def _spread(prefix: str, values: list[float]) -> dict:
    """``{prefix}_mean``, ``{prefix}_std`` (population, over recomputes; None when empty), ``{prefix}_recomputes``."""
    return {f"{prefix}_mean": round(statistics.fmean(values), 4) if values else None,
            f"{prefix}_std": round(statistics.pstdev(values), 4) if values else None,
            f"{prefix}_recomputes": len(values)}


@dataclass(frozen=True)
class ZoomRConfig(PolicyConfig):
    """ZoomR's knobs; its active size follows from the segments (no budget)."""

    window: int = window_knob(WINDOW, WINDOW_SOURCE)
    topk_per_head: int = knob(2, "summaries each layer and query head votes for (k)", minimum=1,
                              source="ZoomR §3.3")
    consensus: int = knob(2, "most-voted segments zoomed in to their full tokens (c)", minimum=0,
                          source="ZoomR §3.3")
    summaries: str = summaries_knob()
    segment_tokens: int = segment_tokens_knob(SEGMENT_TOKENS, SEGMENT_SOURCE)

    def build(self) -> "ZoomRPolicy":
        return ZoomRPolicy(self.window, self.topk_per_head, self.consensus, self.summaries, self.segment_tokens)


class ZoomRPolicy(SegmentedPolicy):
    """ZoomR selection.

    Args:
        window: w, recent generated positions kept (tokens).
        topk: k, segments each (layer, query head) votes for (≥ 1).
        consensus: c, most-voted segments zoomed in (≥ 0).
        summaries: ``model``, ``prompted`` or ``auto``.
        segment_tokens: the longest block in ``auto``/``prompted`` mode (tokens).
    Raises:
        ValueError: k < 1, c < 0, window < 1, segment_tokens < 1, unknown summaries mode.
    """

    name = "zoomr"

    def __init__(self, window: int = WINDOW, topk: int = 2, consensus: int = 2, summaries: str = "auto",
                 segment_tokens: int = SEGMENT_TOKENS):
        if topk < 1:
            raise ValueError(f"zoomr: --topk-per-head must be at least 1, got {topk}")
        if consensus < 0:
            raise ValueError(f"zoomr: --consensus must be >= 0, got {consensus}")
        super().__init__(window, summaries, segment_tokens)
        self.topk, self.consensus = topk, consensus
        self.mean_keys: torch.Tensor | None = None    # [L, Hkv, S, d] float32 on the compute device
        self.queries: dict[int, torch.Tensor] = {}    # layer → [H, d] query of the newest token
        self.ag: list[float] = []                     # the paper's AG, one per recompute with a summary
        self.ag_candidates: list[float] = []          # the selection's AG (see the module docstring)
        self.voted_last = 0                           # |I_all| at the last recompute
        self.n_candidates = 0                         # segments starting before I_w at the last recompute
        self.paper_votes: torch.Tensor | None = None  # [S] votes over all summaries at the last recompute

    def fork(self, ctx):
        """Shares the mean keys (extended by concatenation, never written) and the newest queries
        (replaced each forward): O(L + segments) pointers, plus the AG histories (a float per recompute)."""
        other = super().fork(ctx)
        other.queries, other.ag, other.ag_candidates = dict(self.queries), list(self.ag), list(self.ag_candidates)
        return other

    def observe(self, view: LayerView) -> None:
        """Keep the newest token's query of this layer (scored at the next boundary)."""
        # a copy: a view would keep the forward's whole [H, T, d] queries (a prefill's) alive as policy state
        self.queries[view.layer] = view.q[:, -1].to(torch.float32, copy=True)

    def state_tensors(self):
        """The mean summary keys [L, Hkv, S, d] float32 (S closed segments: 4·L·Hkv·d bytes each) and the
        newest query of each layer ([H, d] float32)."""
        return ([] if self.mean_keys is None else [self.mean_keys]) + list(self.queries.values())

    def on_closed(self, segments: list[Segment]) -> None:
        """Compute the mean keys of newly closed segments from the host store."""
        means = [self.ctx.store.keys(torch.tensor(s.key_positions, dtype=torch.long)).mean(dim=2)
                 for s in segments]                                        # each [L, Hkv, d]
        new = torch.stack(means, dim=2).to(self.ctx.device)
        self.mean_keys = new if self.mean_keys is None else torch.cat([self.mean_keys, new], dim=2)

    def candidates(self, recent: int) -> int:
        """C, how many closed segments start before position ``recent`` (the first of I_w, tokens).

        Segments close in position order, so the candidates are the first C (found by bisection).
        Source: ZoomR §3.5 (the c zoomed paragraphs count on top of the window N_w).
        """
        return bisect.bisect_left(self.tracker.segments, recent, key=lambda s: s.first)

    def votes(self, recent: int) -> torch.Tensor:
        """v_i for every closed segment, ZoomR §3.3: each (layer, query head) votes for its top-k candidates.

        Args:
            recent: first position of I_w (tokens); segments starting there or later get no votes.
        Returns:
            [S] int64 on the CPU, S = closed segments; all zeros before every layer has a query.
        Side effects, read by :meth:`record` for the same recompute: :attr:`n_candidates` = C, and
        :attr:`paper_votes` = [S] int64, the same heads' top-k over all S summaries (ZoomR §3.3 as written,
        for the paper's AG); None before every layer has a query or while no segment is closed.
        """
        S = 0 if self.mean_keys is None else self.mean_keys.shape[2]
        v = torch.zeros(S, dtype=torch.long)
        C = self.n_candidates = self.candidates(recent)
        self.paper_votes = None
        if S == 0 or len(self.queries) < self.ctx.n_layers:
            return v
        q = torch.stack([self.queries[l] for l in range(self.ctx.n_layers)])          # [L, H, d]
        kbar = self.mean_keys.repeat_interleave(self.ctx.group, dim=1)                 # [L, H, S, d]
        alpha = torch.einsum("lhd,lhsd->lhs", q, kbar)                                 # [L, H, S]
        self.paper_votes = _count_top(alpha, self.topk)
        if C:
            v[:C] = _count_top(alpha[:, :, :C], self.topk)
        return v

    def choose(self, recent):
        v = self.votes(recent)
        voted = [i for i in range(len(v)) if v[i] > 0]
        ranked = sorted(voted, key=lambda i: (-int(v[i]), -i))
        zoomed = sorted(ranked[:self.consensus])
        summarized = sorted(ranked[self.consensus:])
        return zoomed, summarized, {i: int(v[i]) for i in voted}

    def record(self, zoomed, votes):
        """Book-keep both AGs of this recompute; return the paper's (None while no summary is closed).

        The paper's (§4): I_c = the c most-voted of :attr:`paper_votes`, AG = Σ_{I_c} v_i / Σ v_j, at every
        recompute that has a summary to vote for. The selection's (zoomr's own): ``votes`` and ``zoomed`` as
        :meth:`choose` made them, None where it is 0/0 or fixed by construction (≤ max(c, k) candidates).
        """
        self.voted_last = len(votes)
        total = sum(votes.values())
        if total and self.n_candidates > max(self.consensus, self.topk):
            self.ag_candidates.append(sum(votes[i] for i in zoomed) / total)
        if self.paper_votes is None:
            return None
        counts = sorted(self.paper_votes.tolist(), reverse=True)   # which of equal counts is in I_c: same sum
        ag = sum(counts[:self.consensus]) / sum(counts)
        self.ag.append(ag)
        return ag

    def stats(self) -> dict:
        """The segments' and recomputes' counts, the paper's AG (``ag_mean``, ``ag_std`` over recomputes,
        ``ag_recomputes``), the selection's beside it (``ag_candidates_*``), ``voted_last`` and §3.5's MS."""
        return {**super().stats(), "voted_last": self.voted_last, **_spread("ag", self.ag),
                **_spread("ag_candidates", self.ag_candidates), **self._formula()}

    def _formula(self) -> dict:
        """§3.5's MS on this run's measured lengths (at the last recompute), and its inputs. N_w is the
        window as far as it is filled (min(w, N_g)): the paper's N_g ≫ N_w does not hold in a short run."""
        segs = self.tracker.segments
        if self.n_prompt is None or not segs:
            return {}
        generated = self.end - self.n_prompt
        inputs = {"n_prompt": self.n_prompt, "n_generated": generated, "consensus": self.consensus,
                  "mean_regular": round(statistics.fmean(len(s.regular) for s in segs), 2),
                  "mean_summary": round(statistics.fmean(len(s.summary) for s in segs), 2),
                  "n_voted": self.voted_last, "window": min(self.window, generated)}
        return {"saving_formula": round(memory_saving_formula(**inputs), 3), "formula_inputs": inputs}

    def describe(self) -> str:
        return (f"zoomr(k={self.topk}, c={self.consensus}, window={self.window}, summaries={self.tracker.mode}"
                f"{self.tracker.bounds_note()})")
