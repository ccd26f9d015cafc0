"""Bench metrics: fidelity of a policy's logits to full KV, and per-(policy, budget) aggregates."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


class FidelityMeter:
    """Running top-1 agreement and KL(full ‖ policy) over teacher-forced positions.

    Each :meth:`add` compares one position's logits (float [vocab] each) from full KV and from the
    policy under the same token history. KL is in nats.
    """

    def __init__(self):
        self.n = 0
        self.agree = 0
        self.kl_sum = 0.0

    def add(self, full_logits: np.ndarray, policy_logits: np.ndarray) -> None:
        """Accumulate one position."""
        p = _log_softmax(full_logits)
        q = _log_softmax(policy_logits)
        self.kl_sum += float((np.exp(p) * (p - q)).sum())
        self.agree += int(np.argmax(full_logits) == np.argmax(policy_logits))
        self.n += 1

    def result(self) -> dict:
        """``{"fidelity_top1", "fidelity_kl", "fidelity_tokens"}`` (None when nothing was compared)."""
        if not self.n:
            return {"fidelity_top1": None, "fidelity_kl": None, "fidelity_tokens": 0}
        return {"fidelity_top1": self.agree / self.n, "fidelity_kl": self.kl_sum / self.n, "fidelity_tokens": self.n}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, budget), in first-seen order.

    Row fields: policy, budget, problems, accuracy, fidelity_top1, fidelity_kl, kv_mean_active_tokens,
    kv_peak_active_tokens, kv_mean_active_bytes, full_bytes, saving (×, mean over problems of full/active
    bytes at the end of a run), decode_tok_s, mean_generated_tokens, degeneration_rate (hit the length cap without
    an answer); helper_share and base_tokens (mean candidate tokens sampled by the base) for rescue cells.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["policy"], r["budget"])].append(r)
    rows = []
    for (policy, budget), rs in groups.items():
        rows.append({
            "policy": policy,
            "budget": budget,
            "problems": len(rs),
            "accuracy": _mean([float(r["correct"]) for r in rs]),
            "fidelity_top1": _mean([r.get("fidelity_top1") for r in rs]),
            "fidelity_kl": _mean([r.get("fidelity_kl") for r in rs]),
            "kv_mean_active_tokens": _mean([r["kv_mean_active_tokens"] for r in rs]),
            "kv_peak_active_tokens": max(r["kv_peak_active_tokens"] for r in rs),
            "kv_mean_active_bytes": _mean([r["kv_mean_active_bytes"] for r in rs]),
            "full_bytes": _mean([r["full_bytes"] for r in rs]),
            "saving": _mean([r["saving"] for r in rs]),
            "decode_tok_s": _mean([r["decode_tok_s"] for r in rs]),
            "mean_generated_tokens": _mean([r["tokens_generated"] for r in rs]),
            "degeneration_rate": _mean([float(r["degenerate"]) for r in rs]),
            # rescue / best-of-N cells only (None elsewhere)
            "helper_share": _mean([r.get("helper_share") for r in rs]),
            "base_tokens": _mean([r.get("base_tokens") for r in rs]),
        })
    return rows


def recovered_fraction(acc_rescue: float, acc_evict: float, acc_full: float) -> float | None:
    """(A_rescue − A_evict) / (A_full − A_evict), KV-Rescue's headline metric; None when full = evict."""
    gap = acc_full - acc_evict
    return None if abs(gap) < 1e-12 else (acc_rescue - acc_evict) / gap
