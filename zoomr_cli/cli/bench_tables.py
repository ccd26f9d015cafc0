"""``zoomr bench``'s tables: the main comparison, matched budgets, KV memory and speed, KV-Rescue (rich)."""

from __future__ import annotations

from rich import box
from rich.table import Table

from zoomr.evaluation.match import TOLERANCE
from zoomr.evaluation.records import MATCHED
from zoomr.evaluation.rescue_cells import cell_label
from zoomr.kvstore.registry import REGISTRY, matched_target


def _cell(r: dict, key, fmt: str) -> str:
    value = key(r) if callable(key) else r.get(key)
    if value is None:
        return "—"
    if fmt == "mib":
        return f"{value / 2**20:.2f}"
    if fmt == "kib":
        return f"{value / 2**10:.1f}"
    if key == "bound_tokens" and r.get("bound_measured"):
        return f"{value}*"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, fmt) if fmt else str(value)


def grid(title: str, cols: tuple, rows: list[dict]) -> Table:
    """A compact table: ``cols`` are (header, row key or function of the row, format spec; "" = str)."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 1), collapse_padding=True)
    for i, (head, _, _) in enumerate(cols):
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*(_cell(r, key, fmt) for _, key, fmt in cols))
    return t


def _budget_cell(r: dict) -> str:
    """The B column: the budget, or for matched rows the mean budget chosen, with ≈."""
    if r["budget"] == MATCHED:
        return "—" if r.get("budget_tokens_mean") is None else f"≈{r['budget_tokens_mean']:.0f}"
    return "—" if r["budget"] is None else str(r["budget"])


def _policy_cell(r: dict) -> str:
    """The policy column: the policy, and for a rescue cell its scorer on a line of its own
    (``rescue`` / ``(likelihood scorer, no PRM)``): one line would widen the column by its length."""
    label = cell_label(r["policy"], r.get("scorer"))
    return label.replace(" (", "\n(", 1) if label != r["policy"] else label


MAIN_COLUMNS = (("policy", _policy_cell, ""), ("B", _budget_cell, ""), ("n", "problems", ""), ("acc", "accuracy", ".2f"),
                ("top1", "fidelity_top1", ".3f"), ("KL", "fidelity_kl", ".3f"),
                ("KV", "mean_active_tokens", ".0f"), ("peak", "peak_active_tokens", ""),
                ("bound", "bound_tokens", ""), ("×", "saving", ".2f"), ("×pk", "saving_peak", ".2f"),
                ("no ans", "no_answer_at_cap_rate", ".2f"), ("AG", "ag_mean", ".3f"))
MATCH_COLUMNS = (("policy", _policy_cell, ""), ("n", "problems", ""), ("target KV", "target_active_tokens", ".1f"),
                 ("achieved", "mean_active_tokens", ".1f"), ("target peak", "target_peak_active_tokens", ""),
                 ("peak", "peak_active_tokens", ""), ("B chosen", "budget_tokens_mean", ".0f"),
                 ("worst err", "match_error_max", "+.1%"), ("within ±10%", "matched_within", ""))
MEMORY_COLUMNS = (("policy", _policy_cell, ""), ("B", _budget_cell, ""), ("active MiB", "mean_active_bytes", "mib"),
                  ("full MiB", "full_bytes", "mib"), ("state KiB", "policy_state_bytes", "kib"),
                  ("device MiB", "device_kv_bytes", "mib"),
                  ("host MiB", "host_kv_bytes", "mib"), ("on", "kv_device", ""), ("tok/s", "decode_tok_s", ".1f"),
                  ("gen", "mean_generated_tokens", ".0f"))
RESCUE_COLUMNS = (("B", "budget", ""), ("A full", "acc_full", ".2f"), ("A greedy", "acc_full_greedy", ".2f"),
                  ("A bon", "acc_best_of_n", ".2f"),
                  ("A rescue", "acc_rescue", ".2f"), ("recov", "recovered_fraction", ".0%"),
                  ("helper", "helper_share", ".0%"), ("base tok", "base_tokens_rescue", ".0f"),
                  ("bon tok", "base_tokens_best_of_n", ".0f"), ("ratio", "base_token_ratio", ".2f"),
                  ("no ans", "no_answer_at_cap_rescue", ".2f"), ("bon no ans", "no_answer_at_cap_best_of_n", ".2f"))


def main_table(rows: list[dict]) -> Table:
    """The policies side by side: accuracy, fidelity, active KV, savings, no answer at the cap."""
    return grid("zoomr bench · KV: mean active tokens · bound: policy's (* measured) · ×: saving, mean full / mean "
                 "(active + policy state) bytes · ×pk: at the peak · no ans: no answer at the -n cap · AG: ZoomR's "
                 "agreeability (§4, every recompute, all summaries)", MAIN_COLUMNS, rows)


def match_table(rows: list[dict]) -> Table:
    """The matched-budget rows: each baseline's target, achieved mean, peaks and chosen B."""
    target = REGISTRY[matched_target()].display
    return grid(f"matched budgets · each baseline's measured mean active KV vs {target}'s (within ±{TOLERANCE:.0%} "
                 f"or flagged) · peaks: most positions in one forward ({target}'s set grows, a budget's does not)",
                 MATCH_COLUMNS, [r for r in rows if r["budget"] == MATCHED])


def memory_table(rows: list[dict]) -> Table:
    """KV bytes (active, full, policy state, device/host) and decode speed per row."""
    return grid("KV memory and speed · active: time-averaged, full: final K/V bytes · state: the policy's own "
                 "tensors on the device (scores, mean keys, queries), at the peak · device/host: peak allocated, "
                 "state included (on cpu the same RAM: they add up) · gen: generated tokens", MEMORY_COLUMNS, rows)


def rescue_table(rows: list[dict]) -> Table:
    """KV-Rescue against eviction-only best-of-N per budget (:func:`zoomr.evaluation.rescue_cells.rescue_rows`);
    the title names the scorer (``likelihood scorer, no PRM`` without ``--prm``)."""
    scorers = ", ".join(dict.fromkeys(r["scorer"] for r in rows if r.get("scorer"))) or "—"
    return grid(f"KV-Rescue vs eviction-only best-of-N (bon) · scorer: {scorers} · A full: full-KV best-of-N, same "
                 "sampling and seeds (the recovered fraction's reference) · A greedy: the greedy full cell · recov = "
                 "(A rescue − A bon) / (A full − A bon) · tok = base tokens", RESCUE_COLUMNS, rows)
