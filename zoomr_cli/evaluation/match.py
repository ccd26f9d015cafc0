"""Matched budgets for ``zoomr bench --match-budget``: each evicting baseline gets the budget B whose *measured*
mean active KV equals ZoomR's on the same problem.

A budget is not a mean: R-KV and SnapKV compress on R-KV's schedule, every 128 positions written
(:mod:`zoomr.kvstore.schedule`), so once compressed they attend between B and B + 128; R-KV leaves the prompt
whole until its first compression (up to the first multiple of 128 ≥ P, + 1, whatever B is), SnapKV cuts it
at the prefill; streaming and H2O attend B + 1, and every policy holds less than B before the context reaches
it. So the ZoomR paper's "same budget" comparison is made here on what is measured, in two steps:

1. *Predict.* How many positions these four policies attend at each step depends only on the prompt
   length, the number of decode steps and their knobs, never on the keys' values. The real policy is
   driven through a real :class:`zoomr.kvstore.cache.PolicyKVCache` on tiny random tensors (1 layer, 1 KV
   head) for ZoomR's prompt and generated length, and B is chosen so that the simulated mean active
   KV is closest to the target (bracketed around the rule of thumb, then bisected). The simulation runs the
   policy's own schedule, so the prediction follows it (within 0.3 % of the target in simulation for R-KV and
   SnapKV at 60–200 prompt tokens and 300–2,048 generated). For SnapKV/R-KV at long lengths this lands near
   B = target − buffer/2, the rule of thumb; R-KV's whole-prompt phase sets a floor on its mean that no B
   lowers (a 180-token prompt and 192 generated tokens: about 128 at any B), so a lower target is flagged
   unmatched.
2. *Check.* The bench runs the baseline at that B and compares its measured mean with the target; a
   run whose length differs from ZoomR's is re-predicted at its own length and run once more, and that
   second run is the one kept (never the closer of the two: that would select runs by their output
   length). KV-Rescue and best-of-N cells run once at the B predicted for ZoomR's lengths: they sample,
   so a second try is another sample, and keeping one of two would select on the length that early
   exit changes. Rows whose match stays off by more than :data:`TOLERANCE` are flagged in the records
   and the table; records say how many tries ran and why the kept one was kept (:func:`match_fields`).

A mean is not the whole story: ZoomR's active set grows over a run (a summary per closed segment) while a
budgeted one stays between B and B + slack, so records carry ZoomR's peak beside the target mean.
"""

from __future__ import annotations

import torch

from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.registry import PolicySpec
from zoomr.kvstore.triattention import QueryStats

TOLERANCE = 0.10  # |achieved / target − 1| a matched row may be off by


def simulated_mean_active(spec: PolicySpec, prompt_tokens: int, generated_tokens: int) -> float:
    """Mean active KV (tokens, over decode steps) that ``spec``'s policy attends for this length.

    Args:
        spec: an evicting policy's spec (streaming, h2o, snapkv, rkv); its budget and knobs.
        prompt_tokens: prompt length P (tokens, ≥ 1), prefilled in one forward.
        generated_tokens: tokens generated n; n decode forwards follow the prefill (the generation
            loop decodes every accepted token into the cache).
    Returns:
        the mean over decode forwards of the positions attended (the prompt's size when n = 0).
    Raises:
        ValueError: the spec's knobs are invalid (see :meth:`zoomr.kvstore.registry.PolicySpec.build`).
    """
    g = torch.Generator().manual_seed(0)
    d = 4
    cache = PolicyKVCache(spec.build(), 1, 1, 1, d, torch.device("cpu"), torch.float32)
    if getattr(cache.policy, "needs_query_stats", False):   # TriAttention: its sizes never read the statistics
        cache.policy.use_query_stats(QueryStats.placeholder(1, 1, d))
    sizes = [prompt_tokens] + [1] * max(generated_tokens, 0)
    for T in sizes:
        q, k, v = (torch.randn(1, T, d, generator=g) for _ in range(3))
        cache.update(0, q, k, v)
        cache.end_forward([0] * T, " ")
    return cache.stats().mean_active_tokens


def valid_budgets(spec: PolicySpec, upper: int) -> tuple[int, int] | None:
    """The smallest and largest budget in [1, ``upper``] that ``spec``'s knobs accept (tokens), or None."""
    def ok(b: int) -> bool:
        try:
            spec.with_knobs(budget=b).build()
            return True
        except ValueError:
            return False

    lo = next((b for b in range(1, min(upper, 4096) + 1) if ok(b)), None)
    return None if lo is None or not ok(upper) else (lo, upper)


def predict_budget(spec: PolicySpec, target: float, prompt_tokens: int, generated_tokens: int) -> tuple[int, float]:
    """The budget whose simulated mean active KV is closest to ``target`` (bisection; the mean grows with B).

    Args:
        spec: the baseline (its budget is ignored).
        target: the mean active KV to match (tokens), e.g. ZoomR's measured mean on this problem.
        prompt_tokens, generated_tokens: the run's lengths (tokens).
    Returns:
        (budget B in tokens, its simulated mean active KV in tokens).
    Raises:
        ValueError: no budget is valid with these knobs.
    """
    upper = max(prompt_tokens + generated_tokens, 2)
    span = valid_budgets(spec, upper)
    if span is None:
        raise ValueError(f"{spec.name}: no budget up to {upper} tokens is valid with these knobs")
    lo, hi = span
    mean = {}

    def at(b: int) -> float:
        if b not in mean:
            mean[b] = simulated_mean_active(spec.with_knobs(budget=b), prompt_tokens, generated_tokens)
        return mean[b]

    # bracket around the rule of thumb (mean ≈ B + slack/2 once the context exceeds B), then bisect
    slack = spec.with_knobs(budget=hi).build().slack
    guess = min(max(round(target - slack / 2), lo), hi)
    step = 8
    a, b = guess, guess
    while a > lo and at(a) > target:
        a, step = max(lo, a - step), step * 2
    step = 8
    while b < hi and at(b) < target:
        b, step = min(hi, b + step), step * 2
    lo, hi = (a, b) if a < b else (a, a)
    while hi - lo > 1:  # invariant: the best budget lies in [lo, hi]
        mid = (lo + hi) // 2
        if at(mid) < target:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda b: abs(at(b) - target))
    return best, at(best)


def match_error(achieved: float, target: float) -> float:
    """Relative error of a matched run's measured mean active KV: achieved / target − 1."""
    return achieved / target - 1 if target else float("inf")


def match_fields(zoomr: dict, budget: int, simulated: float, achieved: float, runs: int, kept: str) -> dict:
    """The fields every matched record carries (bench rows and the matched-budgets table read them).

    Args:
        zoomr: ZoomR's record of the problem (``mean_active_tokens``, ``peak_active_tokens``).
        budget: B of the run kept (tokens); simulated: its simulated mean active KV (tokens).
        achieved: the kept run's measured mean active KV (tokens).
        runs: tries that ran (each at its own B); kept: why the kept one was kept, one line.
    Returns:
        budget_tokens, target_active_tokens (ZoomR's mean), target_peak_active_tokens (ZoomR's peak),
        simulated_active_tokens, match_error (achieved / target − 1), matched_within (|error| ≤
        :data:`TOLERANCE`), match_runs, match_kept.
    """
    target = float(zoomr["mean_active_tokens"])
    err = match_error(achieved, target)
    return {"budget_tokens": budget, "target_active_tokens": round(target, 2),
            "target_peak_active_tokens": zoomr.get("peak_active_tokens"),
            "simulated_active_tokens": round(simulated, 2), "match_error": round(err, 4),
            "matched_within": abs(err) <= TOLERANCE, "match_runs": runs, "match_kept": kept}
