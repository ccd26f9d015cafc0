"""PNG plots of a bench: accuracy and fidelity against measured active KV per policy, active KV against generated
tokens for one problem. matplotlib is imported only when plots are written (Agg backend: files, no display)."""

from __future__ import annotations

import zlib
from pathlib import Path

from zoomr.evaluation.atomic import replacing
from zoomr.evaluation.records import BEST_OF_N, RESCUE
from zoomr.evaluation.rescue_cells import cell_label
from zoomr.evaluation.stats import cell_intervals
from zoomr.kvstore.registry import REFERENCE, REGISTRY
from zoomr.evaluation.variants import base_of

# One colour per policy in every figure: a policy's is its registry row's (``PolicyInfo.colour``), the rescue
# cells' are these; names without one get a fallback colour picked from a stable hash of the name.
CELL_COLOURS = {RESCUE: "#7b3294", BEST_OF_N: "#cc79a7"}
FALLBACK_COLOURS = ("#8c564b", "#bcbd22", "#17becf", "#1b9e77", "#e7298a", "#66a61e", "#a6761d", "#386cb0")
BUDGET_STYLES = ("-", "--", ":", "-.")
LOG_SPAN = 8.0  # an axis spanning more than this ratio is drawn on a log scale


def policy_colour(policy: str) -> str:
    """Hex colour of ``policy``: fixed for the known policies and rescue cells, else stable across runs.

    crc32 rather than ``hash()``: Python salts string hashes per process, and a colour must not change between
    two plots of the same bench.
    """
    return _palette().get(policy) or FALLBACK_COLOURS[zlib.crc32(policy.encode()) % len(FALLBACK_COLOURS)]


def _palette() -> dict[str, str]:
    """{name: colour} of the policies with a colour, in registry order, then the rescue cells'. Read at each
    call: a policy registered after import (``register``) is in it."""
    return {**{name: info.colour for name, info in REGISTRY.items() if info.colour}, **CELL_COLOURS}


def plot_title(meta: dict) -> str:
    """``"<model> · <dataset> · n=<problems> · -n <n_predict>"``.

    Raises:
        KeyError: ``meta`` lacks one of model, dataset, problems, n_predict.
    """
    return f"{meta['model']} · {meta['dataset']} · n={meta['problems']} · -n {meta['n_predict']}"


def _policy_order(policies) -> list[str]:
    """Palette order first (the same legend order in every figure), each policy's variants
    (``zoomr:window=256``) right after it, then unknown names as first seen."""
    seen = list(dict.fromkeys(policies))
    palette = _palette()
    ordered = [q for p in palette for q in seen if q == p or (q != p and base_of(q) == p)]
    return ordered + [p for p in seen if p not in ordered]


def log_scale(values: list[float]) -> bool:
    """Whether an axis over ``values`` reads better on a log scale: all positive and spanning > :data:`LOG_SPAN`×.

    A narrower range on a log axis gets one or two ticks and squeezes nothing worth squeezing.
    """
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SPAN


def _scale(ax, which: str, values: list[float]) -> None:
    """Log or linear axis ``which`` ("x"/"y") as :func:`log_scale` says; plain tick labels (no 10^k, no offset)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    if log_scale(values):
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    else:
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        axis.set_major_formatter(fmt)


def _err(value: float, ci) -> tuple[float, float]:
    """(below, above) bar lengths; a percentile interval may miss a rounded row value, so clamp at 0."""
    if ci is None:
        return 0.0, 0.0
    return max(0.0, value - ci[0]), max(0.0, ci[1] - value)


def _bars(errs):
    """errorbar's [below…], [above…] form; None when every bar is empty (single problems draw no caps)."""
    errs = list(errs)
    return [list(e) for e in zip(*errs)] if any(any(e) for e in errs) else None


def _budget_label(budget) -> str:
    return "" if budget is None else f"B={budget}"


def _series(ax, rows: list[dict], ci: dict, metric: str) -> list[float]:
    """One errorbar line per policy through its (mean active KV, metric) points, sorted by KV; returns the xs."""
    xs_all = []
    for policy in _policy_order(r["policy"] for r in rows):
        pts = sorted(((r["mean_active_tokens"], r[metric], r["budget"]) for r in rows
                      if r["policy"] == policy and r[metric] is not None and r["mean_active_tokens"] is not None),
                     key=lambda p: p[0])
        if not pts:
            continue
        colour = policy_colour(policy)
        xs, ys, budgets = zip(*pts)
        cis = [ci.get((policy, b), {}) for b in budgets]
        yerr = _bars(_err(y, c.get(metric)) for y, c in zip(ys, cis))
        xerr = _bars(_err(x, c.get("mean_active_tokens")) for x, c in zip(xs, cis))
        ax.errorbar(xs, ys, yerr=yerr, xerr=xerr, fmt="o-", color=colour, ecolor=colour, elinewidth=0.9,
                    capsize=2.5, markersize=5, linewidth=1.4,
                    label=cell_label(policy, next((r.get("scorer") for r in rows if r["policy"] == policy), None)))
        for x, y, b in pts:
            if b is not None:  # which budget a point is, without a legend entry per budget
                ax.annotate(str(b), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour)
        xs_all += xs
    return xs_all


def _finish_axes(ax, drawn: list[float], rows: list[dict], ylabel: str, empty: str) -> None:
    """Labels, grid and the KV axis; its scale follows every row's KV, so both figures share it."""
    ax.set_xlabel("mean active KV (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        _scale(ax, "x", [r["mean_active_tokens"] for r in rows if r["mean_active_tokens"] is not None])
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="0.4")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)


def _save(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (a temporary name renamed over it, so a reader of the
    folder never opens half a PNG); the format is the name's extension, given to ``savefig`` explicitly."""
    import matplotlib.pyplot as plt

    try:
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def _accuracy_plot(plt, rows, ci, title, bars: bool, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    xs = _series(ax, rows, ci, "accuracy")
    full = [r["accuracy"] for r in rows if r["policy"] == REFERENCE and r["accuracy"] is not None]
    if full:  # the reference level across the whole KV range
        ax.axhline(full[0], color=policy_colour(REFERENCE), linestyle=":", linewidth=0.8, alpha=0.6)
    _finish_axes(ax, xs, rows, "accuracy (pass@1)", "no accuracy recorded")
    ax.set_ylim(-0.03, 1.03)  # a fraction: always the whole 0–1 range, so runs compare by eye
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_title("accuracy vs measured KV" + (" · bars: 95% Wilson (accuracy), bootstrap (KV)" if bars else ""),
                 fontsize=9)
    fig.suptitle(title, fontsize=10)
    _legend(ax)
    return _save(fig, out / "accuracy_vs_kv.png")


def _fidelity_plot(plt, rows, ci, title, bars: bool, out: Path) -> Path:
    fig, (top1, kl) = plt.subplots(1, 2, figsize=(10.0, 4.2))
    xs = _series(top1, rows, ci, "fidelity_top1")
    _finish_axes(top1, xs, rows, "top-1 agreement with full KV", "no fidelity measured")
    top1.set_ylim(top=1.01)
    top1.set_title("top-1 agreement (higher is closer to full)", fontsize=9)
    xs_kl = _series(kl, rows, ci, "fidelity_kl")
    _finish_axes(kl, xs_kl, rows, "KL(full ‖ policy) (nats/token)", "no fidelity measured")
    kl_vals = [r["fidelity_kl"] for r in rows if r["fidelity_kl"] is not None and r["mean_active_tokens"] is not None]
    if kl_vals:
        _scale(kl, "y", kl_vals)
        if kl.get_yscale() == "linear":  # from 0, with room for the markers of policies that match full exactly
            kl.set_ylim(-0.03 * kl.get_ylim()[1], kl.get_ylim()[1])
    kl.set_title("mean KL to full KV (lower is closer)", fontsize=9)
    fig.suptitle(title + (" · bars: 95% bootstrap over problems" if bars else ""), fontsize=10)
    _legend(kl)
    fig.tight_layout()
    return _save(fig, out / "fidelity_vs_kv.png")


def trace_problem(records: list[dict]) -> tuple[str | None, list[dict]]:
    """The problem whose active-KV traces are drawn, and its record per (policy, budget) cell.

    The first problem (record order) that every cell with a trace has run; after an interrupted run none may
    have, and then the one most cells have (first on ties). Returns (None, []) when no record has a trace.
    """
    cells = list(dict.fromkeys((r["policy"], r["budget"]) for r in records if r.get("active_trace")))
    by_problem: dict[str, dict[tuple, dict]] = {}
    for r in records:
        if r.get("active_trace"):
            by_problem.setdefault(r["problem_id"], {}).setdefault((r["policy"], r["budget"]), r)
    if not by_problem:
        return None, []
    pid = max(by_problem, key=lambda p: len(by_problem[p]))  # max() keeps the first of equal counts
    got = by_problem[pid]
    return pid, [got[c] for c in cells if c in got]


def _active_plot(plt, records, title, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.6, 4.4))
    pid, recs = trace_problem(records)
    budgets = list(dict.fromkeys(r["budget"] for r in recs if r["budget"] is not None))
    order = _policy_order(r["policy"] for r in recs)
    recs = sorted(recs, key=lambda r: (order.index(r["policy"]),
                                       budgets.index(r["budget"]) if r["budget"] is not None else -1))
    # colour = policy, line style = budget; each curve is drawn thinner than the one before, so policies whose
    # traces coincide (streaming and H2O evict on the same schedule) still show every colour
    for i, rec in enumerate(recs):
        xs, ys = zip(*rec["active_trace"])  # breakpoints: straight between them, so a polyline is exact
        style = "-" if rec["budget"] is None else BUDGET_STYLES[budgets.index(rec["budget"]) % len(BUDGET_STYLES)]
        width = 1.0 + 2.5 * (len(recs) - 1 - i) / max(len(recs) - 1, 1)
        ax.plot(xs, ys, color=policy_colour(rec["policy"]), linestyle=style, linewidth=width,
                label=" ".join(filter(None, (cell_label(rec["policy"], rec.get("scorer")), _budget_label(rec["budget"])))))
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("active KV (tokens, prompt included)")
    ax.grid(alpha=0.3)
    for which in "xy":
        _scale(ax, which, [])  # linear: a trace starts at 0 generated tokens
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if pid is None:
        ax.text(0.5, 0.5, "no active-KV trace recorded", transform=ax.transAxes, ha="center", va="center",
                color="0.4")
        ax.set_title("active KV per generated token", fontsize=9)
    else:
        ax.set_title(f"active KV per generated token · problem {pid}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    _legend(ax)
    return _save(fig, out / "active_kv_vs_generated.png")


def write_plots(rows: list[dict], records: list[dict], out: Path, meta: dict) -> list[Path]:
    """Write ``accuracy_vs_kv.png``, ``fidelity_vs_kv.png`` and ``active_kv_vs_generated.png`` into ``out``.

    x axes use the *measured* ``mean_active_tokens`` of each row, not the nominal budget, so unbudgeted policies
    (full, SumR, ZoomR) sit where their memory really is. Bars (rows of more than one problem): accuracy 95 %
    Wilson, top-1 / KL / mean KV 95 % bootstrap over problems, from ``records`` grouped by (policy, budget)
    (see :mod:`zoomr.evaluation.stats`). The active-KV figure draws one problem (:func:`trace_problem`), each cell's
    ``active_trace`` ([generated tokens, active tokens] breakpoints) as a polyline.

    Args:
        rows: summary rows (policy, budget, accuracy, fidelity_top1, fidelity_kl, mean_active_tokens).
        records: per-problem records (problem_id, policy, budget, correct, fidelity_top1, fidelity_kl,
            mean_active_tokens, active_trace).
        out: an existing folder.
        meta: model (str), dataset (str), problems (int), n_predict (int), for the titles.
    Returns:
        The three paths, in the order above.
    Raises:
        KeyError: a row, record or ``meta`` lacks a field named above.
        OSError: ``out`` is not writable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = plot_title(meta)
    ci = cell_intervals(records)
    bars = any(v is not None for c in ci.values() for v in c.values())
    return [_accuracy_plot(plt, rows, ci, title, bars, out), _fidelity_plot(plt, rows, ci, title, bars, out),
            _active_plot(plt, records, title, out)]
