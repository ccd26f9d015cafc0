"""Bench metrics: fidelity of a policy's logits to full KV, and per-(policy, budget) aggregates."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch


def fidelity_terms(full_logits, policy_logits) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: KL(full ‖ policy) in nats and whether both argmaxes agree, where the logits live.

    Args:
        full_logits, policy_logits: float [F, vocab] (torch tensors on one device, or numpy), row f of each
            the next-token logits of one position under the same token history.
    Returns:
        (kl [F] float64, agree [F] bool), both on the logits' device (the first maximum wins ties, as
        numpy's argmax).
    """
    full, policy = torch.as_tensor(full_logits), torch.as_tensor(policy_logits)
    p = torch.log_softmax(full.double(), dim=-1)
    q = torch.log_softmax(policy.double(), dim=-1)
    kl = (p.exp() * (p - q)).sum(-1)
    return kl, full.argmax(-1) == policy.argmax(-1)


class FidelityMeter:
    """Running top-1 agreement and KL(full ‖ policy) over teacher-forced positions, summed on the device the
    logits live on: only the final numbers cross to the host (:meth:`result`).

    Each :meth:`add` compares one position's logits (float [vocab] each) from full KV and from the
    policy under the same token history. KL is in nats.
    """

    def __init__(self):
        self.n = 0
        self.agree = 0
        self.kl_sum = 0.0

    def add(self, full_logits, policy_logits) -> None:
        """Accumulate one position (numpy or torch [vocab] rows)."""
        kl, agree = fidelity_terms(torch.as_tensor(full_logits)[None], torch.as_tensor(policy_logits)[None])
        self.accumulate(kl[0], agree[0])

    def accumulate(self, kl: torch.Tensor, agree: torch.Tensor) -> None:
        """Accumulate one position from its :func:`fidelity_terms` (0-d tensors; no host transfer)."""
        self.kl_sum = self.kl_sum + kl
        self.agree = self.agree + agree.long()
        self.n += 1

    def result(self) -> dict:
        """``{"fidelity_top1", "fidelity_kl", "fidelity_tokens"}`` (None when nothing was compared)."""
        if not self.n:
            return {"fidelity_top1": None, "fidelity_kl": None, "fidelity_tokens": 0}
        return {"fidelity_top1": int(self.agree) / self.n, "fidelity_kl": float(self.kl_sum) / self.n,
                "fidelity_tokens": self.n}


def _sig(x: float) -> float:
    # 9 significant digits: a mean of rounded record fields then reads 3.3, not 3.3000000000000003
    return float(f"{x:.9g}")


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return _sig(np.mean(vals)) if vals else None


def _ratio(num, den):
    num, den = [v for v in num if v is not None], [v for v in den if v is not None]
    return _sig(sum(num) / sum(den)) if num and den and sum(den) else None


def _plus(a, b):
    # per record: bytes + policy state bytes (records written before the state was counted carry none)
    return [None if x is None else x + (y or 0) for x, y in zip(a, b)]


def _max(vals):
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _extra(record: dict) -> dict:
    """A record's ``kv_extra`` (the policy's own statistics), {} when it has none."""
    x = record.get("kv_extra")
    return x if isinstance(x, dict) else {}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, budget), in first-seen order.

    Row fields (units: tokens, bytes, ×, tokens/s):
        policy, budget, problems, accuracy, fidelity_top1, fidelity_kl (nats/token);
        mean_active_tokens (mean over problems of each run's time-averaged active KV), peak_active_tokens and
        bound_tokens (max over problems; ``bound_measured`` when any bound is a measured peak),
        mean_active_bytes, mean_full_bytes, full_bytes (means over problems; full_bytes at each run's end);
        saving = Σ mean full bytes / Σ (mean active + mean policy state bytes) over the row's runs
        (time-averaged, the same steps), saving_peak = Σ full bytes / Σ (peak active + policy state bytes);
        policy_state_bytes (max over problems), mean_policy_state_bytes (mean over problems);
        device_kv_bytes (policy state included), host_kv_bytes (peak over problems of what was allocated), kv_device;
        decode_tok_s, mean_generated_tokens, no_answer_at_cap_rate (hit the length cap without an answer),
        multi_boxed_rate (answers with more than one distinct ``\\boxed{}`` value);
        matched budgets only: budget_tokens_mean (the budgets chosen), target_active_tokens (ZoomR's mean),
        target_peak_active_tokens (ZoomR's peak, max over problems),
        match_error_max (largest |achieved/target − 1|), matched_within (all rows within the tolerance);
        rescue cells only (rescue, best-of-n, full-best-of-n): helper_share, base_tokens, method_kv_bytes_mean,
        scorer (the cells' ``scorer`` label: ``likelihood:HELPER`` or ``prm:PATH``) (None elsewhere);
        zoomr only: ag_mean, ag_std (means over problems of each run's AG mean and spread over its recomputes,
        the paper's AG of ZoomR §4, ``kv_extra``), ag_candidates_mean (the same of zoomr's own AG, the
        selection's votes; :mod:`zoomr.kvstore.zoomr`), saving_formula (mean over problems of ZoomR §3.5's MS on
        each run's own lengths, beside the measured ``saving``) (None elsewhere);
        SumR and ZoomR: recomputes (mean per problem), summaries_per_1k_tokens (delimited summaries the model
        wrote per 1,000 generated tokens, over the row's runs) (None elsewhere).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["policy"], r["budget"])].append(r)
    rows = []
    for (policy, budget), rs in groups.items():
        get = lambda key: [r.get(key) for r in rs]  # noqa: E731 — a column of this group
        extra = lambda key: [_extra(r).get(key) for r in rs]  # noqa: E731 — the policy's own numbers
        errors = [e for e in get("match_error") if e is not None]
        rows.append({
            "policy": policy,
            "budget": budget,
            "problems": len(rs),
            "accuracy": _mean([float(r["correct"]) for r in rs]),
            "fidelity_top1": _mean(get("fidelity_top1")),
            "fidelity_kl": _mean(get("fidelity_kl")),
            "mean_active_tokens": _mean(get("mean_active_tokens")),
            "peak_active_tokens": _max(get("peak_active_tokens")),
            "bound_tokens": _max(get("bound_tokens")),
            "bound_measured": any(bool(v) for v in get("bound_measured")),
            "mean_active_bytes": _mean(get("mean_active_bytes")),
            "mean_full_bytes": _mean(get("mean_full_bytes")),
            "full_bytes": _mean(get("full_bytes")),
            "saving": _ratio(get("mean_full_bytes"), _plus(get("mean_active_bytes"), get("mean_policy_state_bytes"))),
            "saving_peak": _ratio(get("full_bytes"), _plus(get("peak_active_bytes"), get("policy_state_bytes"))),
            "policy_state_bytes": _max(get("policy_state_bytes")),
            "mean_policy_state_bytes": _mean(get("mean_policy_state_bytes")),
            "device_kv_bytes": _max(get("device_kv_bytes")),
            "host_kv_bytes": _max(get("host_kv_bytes")),
            "kv_device": next((v for v in get("kv_device") if v), None),
            "decode_tok_s": _mean(get("decode_tok_s")),
            "mean_generated_tokens": _mean(get("tokens_generated")),
            "no_answer_at_cap_rate": _mean([float(bool(v)) for v in get("no_answer_at_cap")]),
            "multi_boxed_rate": _mean([None if v is None else float(v > 1) for v in get("n_boxed_distinct")]),
            "budget_tokens_mean": _mean(get("budget_tokens")) if budget == "matched" else None,
            "target_active_tokens": _mean(get("target_active_tokens")),
            "target_peak_active_tokens": _max(get("target_peak_active_tokens")),
            "match_error_max": max(errors, key=abs) if errors else None,
            "matched_within": all(bool(v) for v in get("matched_within")) if errors else None,
            "helper_share": _mean(get("helper_share")),
            "base_tokens": _mean(get("base_tokens")),
            "method_kv_bytes_mean": _mean(get("method_kv_bytes_mean")),
            "scorer": next((v for v in get("scorer") if v), None),
            "ag_mean": _mean(extra("ag_mean")),
            "ag_std": _mean(extra("ag_std")),
            "ag_candidates_mean": _mean(extra("ag_candidates_mean")),
            "saving_formula": _mean(extra("saving_formula")),
            "recomputes": _mean(extra("recomputes")) if any(v is not None for v in extra("summaries_written")) else None,
            "summaries_per_1k_tokens": _per_1k(extra("summaries_written"), get("tokens_generated")),
        })
    return rows


def _per_1k(counts: list, tokens: list) -> float | None:
    """Σ counts per 1,000 of Σ tokens over the runs that have a count; None when none has one."""
    pairs = [(c, t) for c, t in zip(counts, tokens) if c is not None and t]
    total = sum(t for _, t in pairs)
    return round(1000 * sum(c for c, _ in pairs) / total, 3) if total else None


def recovered_fraction(acc_rescue: float, acc_evict: float, acc_full: float) -> float | None:
    """(A_rescue − A_evict) / (A_full − A_evict), KV-Rescue's headline metric; None when full = evict."""
    gap = acc_full - acc_evict
    return None if abs(gap) < 1e-12 else (acc_rescue - acc_evict) / gap
