"""``zoomr bench --rescue``: KV-Rescue and its eviction-only best-of-N baseline as bench cells.

Source: KV-Rescue (arXiv:2608.15797), "Accuracy versus KV Budget" and "Generation Length". Per budget B
two cells run on every problem, both with the base model's evicting policy (``--base-policy``, R-KV by
default) at budget B and the same stepwise loop, sampler seed and scorer:

- ``rescue``: N_b base + N_h full-KV helper candidates per step;
- ``best-of-n``: N_b base candidates only (N_h = 0), the paper's eviction-only best-of-N.

The headline numbers come from those two and the bench's ``full`` cell (full KV, the bench's own
sampling): recovered fraction (A_rescue − A_best-of-n) / (A_full − A_best-of-n), helper share of
committed steps, and base-model tokens sampled by rescue relative to best-of-N (the paper: 87 %
recovered and 43 % fewer base tokens at B = 64 with 7B/1.5B models).

A run's trajectory is capped at the bench's ``-n`` new tokens (prompt + n ≤ ``-c``), so the rescue
cells are comparable with the single-sample cells' length cap; degenerate = stopped by that cap, the
step limit, or an all-aborted step, without an answer.
"""

from __future__ import annotations

from dataclasses import replace

from backends.sampling import Sampler

from .bench_metrics import recovered_fraction
from .datasets import Problem
from .factory import with_policy
from .grading import grade
from .options import RunOptions
from .rescue_cli import build_helper, rescue_once
from .rescue_options import RescueOptions, RescuePlan, for_flag, plan_rescue
from .scorers import build_scorer
from .solve import solve_prompt

RESCUE, BEST_OF_N = "rescue", "best-of-n"


def rescue_sampling(opts: RunOptions):
    """The candidates' sampling: the bench's flags, but T 0.8 (the paper's) unless ``--temp`` is given."""
    return opts.sampling(default_temp=0.8)


def plan(ropts: RescueOptions, opts: RunOptions) -> tuple[RescuePlan, dict]:
    """Resolve and check the ``--rescue`` flags before any model loads.

    Returns:
        (the plan, the settings config.json records: a ``--resume`` must not change them).
    Raises:
        UserError / ValueError: bad flags, an unknown base policy, helper or PRM (one line).
    """
    p = plan_rescue(ropts, opts)
    settings = {"base_policy": p.base_opts.policy, "helper": p.helper_opts.model or "default", "prm": p.prm,
                "sampling": vars(rescue_sampling(opts)),
                **{k: v for k, v in p.config.as_dict().items() if k != "max_context"}}
    return p, settings


class RescueCells:
    """Builds the helper and scorer once and runs the rescue / best-of-N cells of each problem.

    Args:
        base: the bench's full-KV torch backend (the base model; evicting views are made per budget).
        opts: the bench's run options; plan: the resolved ``--rescue`` flags (see :func:`plan`).
    Raises:
        UserError / ValueError: a bad helper or PRM (one line, before any cell runs).
    """

    def __init__(self, base, opts: RunOptions, plan: RescuePlan):
        self.plan, self.opts, self.base = plan, opts, base
        self.sampling = rescue_sampling(opts)
        self.scorer = for_flag("--prm", build_scorer, plan.prm, opts.device, opts.dtype)
        self.helper = for_flag("--helper", build_helper, base, plan.helper_opts)

    @staticmethod
    def cells(budgets: list) -> list[tuple[str, object]]:
        """(policy, budget) cells per problem: best-of-N first, then rescue, for each budget."""
        return [(p, b) for b in budgets for p in (BEST_OF_N, RESCUE)]

    def run(self, policy: str, budget: int, problem: Problem, base_ids: list[int], n_predict: int) -> dict:
        """One cell: the stepwise loop on ``problem`` with the base evicting to ``budget`` tokens.

        Args:
            base_ids: the problem's prompt in the base model's tokens (the bench's own prompt).
            n_predict: most new tokens of the committed trajectory (tokens; -1: up to ``-c``).

        Returns:
            record fields shared with the single-sample cells (correct, tokens_generated, degenerate,
            kv_* of the base, saving, decode_tok_s = candidate tokens of both models per second) plus
            steps, helper_share, base_tokens, helper_tokens, candidates, aborted.
        Raises:
            KeyboardInterrupt: Ctrl-C during the cell (nothing of it is recorded).
        """
        base = with_policy(self.base, replace(self.opts, policy=self.plan.base_opts.policy, budget=budget))
        helper_ids = solve_prompt(self.helper.tokenizer, problem.question)
        cap = max(len(base_ids), len(helper_ids)) + n_predict if n_predict > 0 else self.opts.ctx_size
        config = replace(self.plan.config, max_context=min(cap, self.opts.ctx_size),
                                     nh=0 if policy == BEST_OF_N else self.plan.config.nh)
        reason, transcript = rescue_once(base, self.helper, self.scorer, Sampler(self.sampling), config,
                                         problem.question, base_ids, helper_ids)
        if reason == "interrupted":
            raise KeyboardInterrupt
        s = transcript.summary()
        snaps = [transcript.start.kv["base"]]  # after the prompt, then after every commit
        snaps += [e["stats"] for e in transcript.events if e["event"] == "kv" and e["role"] == "base"]
        last = s["kv"]["base"]  # the prompt's state when no step was committed
        mean_active = sum(k["active_tokens"] for k in snaps) / len(snaps)
        token_bytes = last["full_bytes"] // max(last["full_tokens"], 1)
        sampled = s["base_tokens"] + s["helper_tokens"]
        return {
            "answer": s["answer"],
            "correct": grade(problem.gold, s["answer"]),
            "tokens_generated": sum(st["tokens"] for st in s["steps"]),
            "stop_reason": "length" if reason == "context" and config.max_context < self.opts.ctx_size else reason,
            "degenerate": reason != "eos" and s["answer"] is None,
            "kv_mean_active_tokens": round(mean_active, 2),
            "kv_peak_active_tokens": last["peak_active_tokens"],
            "kv_mean_active_bytes": int(mean_active * token_bytes),
            "full_tokens": last["full_tokens"],
            "full_bytes": last["full_bytes"],
            "saving": last["saving"],
            "decode_tok_s": round(sampled / s["seconds"], 2) if s["seconds"] else None,
            "active_trace": [[k["full_tokens"] - len(base_ids), k["active_tokens"]] for k in snaps],
            "steps": len(s["steps"]),
            "helper_share": s["helper_share"],
            "base_tokens": s["base_tokens"],
            "helper_tokens": s["helper_tokens"],
            "candidates": s["candidates"],
            "aborted": s["aborted"],
            "text": "".join(st["text"] for st in s["steps"]),
            "wall_s": s["seconds"],
        }


def rescue_rows(rows: list[dict]) -> list[dict]:
    """KV-Rescue's headline numbers per budget, from :func:`zoomr_cli.bench_metrics.summarize` rows.

    Fields: budget, acc_full, acc_best_of_n, acc_rescue, recovered_fraction (None when full = best-of-N
    or a row is missing), helper_share, base_tokens_rescue, base_tokens_best_of_n, base_token_ratio
    (rescue / best-of-N), degeneration_rescue, degeneration_best_of_n.
    """
    by = {(r["policy"], r["budget"]): r for r in rows}
    full = by.get(("full", None))
    out = []
    for budget in dict.fromkeys(r["budget"] for r in rows if r["policy"] == RESCUE):
        res, bon = by[(RESCUE, budget)], by.get((BEST_OF_N, budget))
        acc_full = full["accuracy"] if full else None
        acc_bon = bon["accuracy"] if bon else None
        ratio = None
        if bon and bon.get("base_tokens"):
            ratio = res["base_tokens"] / bon["base_tokens"]
        out.append({
            "budget": budget,
            "acc_full": acc_full,
            "acc_best_of_n": acc_bon,
            "acc_rescue": res["accuracy"],
            "recovered_fraction": (None if acc_full is None or acc_bon is None
                                   else recovered_fraction(res["accuracy"], acc_bon, acc_full)),
            "helper_share": res.get("helper_share"),
            "base_tokens_rescue": res.get("base_tokens"),
            "base_tokens_best_of_n": bon.get("base_tokens") if bon else None,
            "base_token_ratio": ratio,
            "degeneration_rescue": res["degeneration_rate"],
            "degeneration_best_of_n": bon["degeneration_rate"] if bon else None,
        })
    return out
