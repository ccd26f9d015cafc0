"""PNG plots of a bench: accuracy and fidelity against active KV per policy, active KV against generated tokens."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def write_plots(rows: list[dict], records: list[dict], out: Path) -> list[Path]:
    """Write the plots into ``out``; returns their paths.

    x axes use the *measured* mean active KV (tokens), not the nominal budget, so unbudgeted policies
    (full, SumR, ZoomR) sit where their memory really is.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = []
    by_policy = defaultdict(list)
    for r in rows:
        by_policy[r["policy"]].append(r)
    for metric, label, fname in (("accuracy", "pass@1 accuracy", "accuracy_vs_kv.png"),
                                 ("fidelity_top1", "top-1 agreement with full KV", "fidelity_vs_kv.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for policy, rs in by_policy.items():
            pts = sorted((r["kv_mean_active_tokens"], r[metric]) for r in rs if r[metric] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=policy)
        ax.set_xlabel("mean active KV (tokens)")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(out / fname)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    seen = set()
    # colour = policy, line style = budget: more than ten curves stay tellable apart
    colours = {p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys(r["policy"] for r in records))}
    styles = {b: ("-", "--", ":", "-.")[i % 4] for i, b in enumerate(dict.fromkeys(r["budget"] for r in records))}
    for rec in records:
        key = (rec["policy"], rec["budget"])
        if key in seen or not rec.get("active_trace"):
            continue  # one curve per (policy, budget): the first problem's
        seen.add(key)
        xs, ys = zip(*rec["active_trace"])
        ax.plot(xs, ys, color=colours[rec["policy"]], linestyle=styles[rec["budget"]],
                label=rec["policy"] + ("" if rec["budget"] is None else f" B={rec['budget']}"))
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("active KV (tokens)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "active_kv_vs_generated.png", dpi=110)
    plt.close(fig)
    paths.append(out / "active_kv_vs_generated.png")
    return paths
