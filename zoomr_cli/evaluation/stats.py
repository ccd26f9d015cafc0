"""Confidence intervals for bench rows: Wilson for accuracy, a seeded percentile bootstrap for means over problems.

No plotting here, so the numbers can be tested (and reused by tables) without matplotlib.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

Z95 = 1.959963984540054  # standard normal 0.975 quantile: two-sided 95 %
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# record fields whose per-problem mean gets a bootstrap interval (accuracy gets Wilson instead)
MEAN_FIELDS = ("fidelity_top1", "fidelity_kl", "mean_active_tokens")


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    Unlike the normal (Wald) interval it stays inside [0, 1] and does not collapse to zero width at 0/n or n/n,
    which matters at the handful of problems a bench runs. Source: Wilson (1927), "Probable inference, the law of
    succession, and statistical inference", JASA 22; recommended by Brown, Cai & DasGupta (2001), Stat. Sci. 16.

    Args:
        successes: number of correct answers, 0 ≤ successes ≤ n.
        n: number of problems, ≥ 1.
        z: normal quantile (1.96 for 95 %).
    Returns:
        (low, high), fractions in [0, 1].
    Raises:
        ValueError: n < 1 or successes outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p = successes / n
    z2n = z * z / n
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    # the exact ends are 0 and 1 at 0/n and n/n; clamp only the rounding
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean_interval(values, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                            seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: resample the values with replacement, take the quantiles.

    Deterministic for a given ``seed`` (numpy's PCG64), so a redrawn plot shows the same bars. With very few values
    the percentile interval is narrower than the truth (it cannot reach beyond the observed range); it is still
    the honest "how much does this mean move with the problems drawn". Source: Efron & Tibshirani (1993),
    *An Introduction to the Bootstrap*, ch. 13.

    Args:
        values: per-problem numbers, 1-D, length ≥ 1 (any unit; the interval has the same unit).
        level: coverage, in (0, 1).
        resamples: number of bootstrap resamples.
        seed: seed of the resampling generator.
    Returns:
        (low, high) of the mean.
    Raises:
        ValueError: no values, or level outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("bootstrap_mean_interval: no values")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap_mean_interval: level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def cell_intervals(records: list[dict]) -> dict[tuple, dict[str, tuple[float, float] | None]]:
    """95 % intervals per (policy, budget) cell, from the per-problem records.

    Keys are ``(policy, budget)`` as in the summary rows. Each value maps ``"accuracy"`` (Wilson over ``correct``)
    and each of :data:`MEAN_FIELDS` (bootstrap over the problems where the field is not None) to ``(low, high)``,
    or to None when fewer than two problems carry it: one problem has no spread to show.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["policy"], r["budget"])].append(r)
    out = {}
    for key, rs in groups.items():
        n = len(rs)
        ci = {"accuracy": wilson_interval(sum(bool(r["correct"]) for r in rs), n) if n > 1 else None}
        for field in MEAN_FIELDS:
            vals = [r[field] for r in rs if r.get(field) is not None]
            ci[field] = bootstrap_mean_interval(vals) if len(vals) > 1 else None
        out[key] = ci
    return out
