"""``zoomr bench --rescue``: KV-Rescue and its eviction-only best-of-N baseline as bench cells.

Source: KV-Rescue (arXiv:2608.15797), "Accuracy versus KV Budget" and "Generation Length". Per budget B
two cells run on every problem, both with the base model's evicting policy (``--base-policy``, R-KV by
default) at budget B, and one more per problem with full KV; all three the same stepwise loop, sampling
(T 0.8 unless ``--temp``), sampler seed (each candidate's stream keyed by step and index), N_b and scorer:

- ``rescue``: N_b base + N_h full-KV helper candidates per step, the degeneration detector as set
  (``--detector zoomr``, the calibrated default, or ``paper``; ``--no-detector`` gives the paper's
  no-early-exit ablation);
- ``best-of-n``: N_b base candidates only (N_h = 0) and *no* detector, whatever the detector flags
  say: the paper's eviction-only best-of-N, whose runaway generations are what early exit prevents
  (13.4 % degeneration at B = 64). A detector-on best-of-N is not a bench cell: it is no baseline of
  the paper (``zoomr solve --rescue --nh 0`` runs it for a look);
- ``full-best-of-n`` (budget none): the same best-of-N with the base on full KV, the sampled full-KV
  reference A_full.

The headline numbers come from those three: recovered fraction (A_rescue − A_best-of-n) / (A_full −
A_best-of-n) with A_full the ``full-best-of-n`` accuracy, so all three accuracies come from the same
sampling, seeds and number of samples (``full_reference: "sampled"`` in ``summary.json["rescue"]``; the
bench's greedy ``full`` cell, the fidelity reference, is shown beside it as ``acc_full_greedy`` and enters
no fraction), helper share of committed steps, and base-model tokens sampled by rescue relative to
best-of-N (the paper: 87 % recovered and 43 % fewer base tokens at B = 64 with 7B/1.5B models).

Without ``--prm`` the cells are scored by the helper's mean log-likelihood: their rows and labels in the
tables and plots say "likelihood scorer, no PRM" (:func:`cell_label`), with a PRM they name it.

With ``--match-budget`` the base's B is chosen per problem as for every matched baseline: predicted from
ZoomR's measured mean active KV and lengths through the base policy itself
(:func:`zoomr.evaluation.match.predict_budget`, which counts R-KV's buffer of 128 that ZoomR's mean taken
as B would not: about 64 positions more); one try, no selection (:meth:`RescueCells.run_matched`).

A run's trajectory is capped at the bench's ``-n`` new tokens (prompt + n ≤ ``-c``), so the rescue
cells are comparable with the single-sample cells' length cap; ``no_answer_at_cap`` = stopped by that
cap, the step limit, or an all-aborted step, without an answer.

Memory ("Overhead derivation", KV memory: the helper's and the PRM's caches stay full, and the
full-method memory adds them to the evicted base's). A record keeps the base's own figures under the
names of every bench record and adds the method's total; each model's KV is time-averaged over the
committed trajectory, one sample per committed token (see
:meth:`zoomr.rescue.transcript.Transcript.trajectory_kv`). Candidate forks are not counted: this loop
runs candidates one after another, a batched implementation shares their prefix; the figures are
those of the trajectory, independent of N and of how candidates are scheduled.

- ``mean_active_tokens`` / ``mean_active_bytes`` / ``mean_full_bytes``: the base, time-averaged;
  ``peak_active_tokens``: the base's committed state (prompt prefill included); ``full_tokens`` /
  ``full_bytes``: the base's full KV at the end.
- ``helper_kv_bytes_mean`` / ``helper_kv_bytes_peak``: the helper's full KV (time-averaged / at its
  largest); 0 when the method does not use the helper (best-of-N with a PRM: zoomr's helper still
  follows the trajectory, a cost of this implementation, not of the baseline).
- ``prm_kv_bytes_peak``: the PRM's KV while scoring, at its largest (0 when no separate PRM runs: the
  likelihood fallback scores with the helper's KV, already counted).
- ``policy_state_bytes`` / ``mean_policy_state_bytes``: the base policy's state on the device (R-KV's
  query window, H2O's scores), at its largest / time-averaged over the base's forwards.
- ``method_kv_bytes_mean`` = base mean + base policy state mean + helper mean + PRM peak (the PRM keeps
  its conversation's KV between steps, so its peak stands in for its mean: never an under-count);
  ``method_kv_bytes_peak`` = base peak + base state peak + helper peak + PRM peak (peaks of different
  moments: an upper bound).
- ``saving`` = base mean full bytes / ``method_kv_bytes_mean`` and ``saving_peak`` = base full bytes /
  ``method_kv_bytes_peak``: what the method saves against the base with full KV, so rescue is not
  credited for memory its helper and PRM hold (the base alone saves mean_full / mean_active bytes).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zoomr.backends.sampling import Sampler

from zoomr.evaluation.match import match_fields, predict_budget
from zoomr.evaluation.metrics import recovered_fraction
from zoomr.evaluation.bench_cells import cell_policy
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import Problem
from zoomr.evaluation.records import BEST_OF_N, FULL_BEST_OF_N, RESCUE, RESCUE_CELLS
from zoomr.factory import policy_spec, with_policy
from zoomr.grading import grade
from zoomr.kvstore.registry import REFERENCE, matched_target
from zoomr.options import RunOptions
from zoomr.rescue.loop import RescueConfig
from zoomr.rescue.runner import build_helper, rescue_once
from zoomr.rescue.plan import RescueOptions, RescuePlan, for_flag, plan_rescue
from zoomr.rescue.transcript import Transcript
from zoomr.rescue.scorers import build_scorer



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
    # early_exit and the detector are the rescue cells'; best-of-n and full-best-of-n always run without early exit
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

    def __init__(self, base, opts: RunOptions, plan: RescuePlan, factories: dict | None = None):
        self.plan, self.opts, self.base = plan, opts, base
        # the base policy's validated cache factory per budget (zoomr.evaluation.bench_plan.validate_cells):
        # each problem reuses it instead of building the policy again
        self.factories = factories or {}
        self.sampling = rescue_sampling(opts)
        self.scorer = for_flag("--prm", build_scorer, plan.prm, opts.device, opts.dtype)
        self.helper = for_flag("--helper", build_helper, base, plan.helper_opts)
        self.helper_is_base = same_model(self.helper.source, base.source)
        self.scorer_label = self.scorer.label(str(self.helper.source.path))

    @staticmethod
    def cells(budgets: list) -> list[tuple[str, object]]:
        """(policy, budget) cells per problem: the sampled full-KV reference once (budget None), then best-of-N
        and rescue for each budget."""
        return [(FULL_BEST_OF_N, None)] + [(p, b) for b in budgets for p in (BEST_OF_N, RESCUE)]

    def config(self, policy: str, n_predict: int) -> RescueConfig:
        """The loop settings of ``policy``'s cell, its trajectory capped at ``n_predict`` new tokens: best-of-N
        (evicted or on full KV) has no helper candidate and no early exit."""
        c = replace(self.plan.config, max_new_tokens=n_predict)
        return replace(c, nh=0, early_exit=False) if policy in (BEST_OF_N, FULL_BEST_OF_N) else c

    def run(self, policy: str, budget: int, problem: Problem, base_ids: list[int], n_predict: int) -> dict:
        """One cell: the stepwise loop on ``problem`` with the base evicting to ``budget`` tokens (full KV for
        ``full-best-of-n``, whose budget is None).

        Args:
            base_ids: the problem's prompt in the base model's tokens (the bench's own prompt).
            n_predict: most new tokens of the committed trajectory (tokens; -1: up to ``-c``).

        Returns:
            record fields shared with the single-sample cells (answer, correct, tokens_generated,
            stop_reason, no_answer_at_cap, the base's mean_active_tokens, peak_active_tokens,
            mean_active_bytes, mean_full_bytes, full_tokens, full_bytes, policy_state_bytes,
            mean_policy_state_bytes, saving and saving_peak of the method, decode_tok_s = candidate
            tokens of both models per second, active_trace) plus the method's memory (helper_kv_bytes_mean, helper_kv_bytes_peak, prm_kv_bytes_peak,
            method_kv_bytes_mean, method_kv_bytes_peak; see the module docstring), scorer (its
            :meth:`zoomr.rescue.scorers.Scorer.label`), helper_is_base, early_exit, detector (``zoomr`` or
            ``paper``: which one read the base candidates; it aborts only with early_exit), steps,
            helper_share, base_tokens, helper_tokens, candidates, aborted, text, wall_s.
        Raises:
            KeyboardInterrupt: Ctrl-C during the cell (nothing of it is recorded).
        """
        key = cell_policy(policy, budget, self.plan.base_opts.policy)
        if key in self.factories:
            base = self.base.with_cache_factory(self.factories[key])
        elif policy == FULL_BEST_OF_N:   # the bench's base already runs full KV
            base = self.base
        else:   # a matched budget, chosen for this problem
            base = with_policy(self.base, replace(self.opts, policy=key[0]).with_knobs(budget=budget))
        helper_ids = problem_prompt(self.helper.tokenizer, problem, self.opts.ctx_size)
        config = self.config(policy, n_predict)
        self.scorer.reset_kv_peak()
        reason, transcript = rescue_once(base, self.helper, self.scorer, Sampler(self.sampling), config,
                                         problem.question, base_ids, helper_ids)
        if reason == "interrupted":
            raise KeyboardInterrupt
        s = transcript.summary()
        sampled = s["base_tokens"] + s["helper_tokens"]
        return {
            "answer": s["answer"],
            "correct": grade(problem.gold, s["answer"]),
            "tokens_generated": sum(st["tokens"] for st in s["steps"]),
            "stop_reason": reason,
            "no_answer_at_cap": reason != "eos" and s["answer"] is None,
            **self.memory(transcript, uses_helper=config.nh > 0 or self.scorer.uses_helper),
            "decode_tok_s": round(sampled / s["seconds"], 2) if s["seconds"] else None,
            "active_trace": active_trace(transcript, len(base_ids)),
            "scorer": self.scorer_label,
            "helper_is_base": self.helper_is_base,
            "early_exit": config.early_exit,
            "detector": config.detector.name,
            "steps": len(s["steps"]),
            "helper_share": s["helper_share"],
            "base_tokens": s["base_tokens"],
            "helper_tokens": s["helper_tokens"],
            "candidates": s["candidates"],
            "aborted": s["aborted"],
            "text": "".join(st["text"] for st in s["steps"]),
            "wall_s": s["seconds"],
        }

    def run_matched(self, policy: str, problem: Problem, base_ids: list[int], n_predict: int, zoomr: dict) -> dict:
        """One matched cell: the base's B predicted for ZoomR's measured mean active KV at ZoomR's prompt and
        generated lengths (through the base policy, as every matched baseline), then one run at it.

        One try: the cell samples (T 0.8), so another try is another sample, and keeping the closer of two
        would select on output length, the very thing early exit changes; a miss stays in the record
        (``match_error``, ``matched_within``) and the table flags it.

        Args:
            zoomr: ZoomR's record of the problem (``mean_active_tokens``, ``peak_active_tokens``,
                ``tokens_generated``); other args as :meth:`run`.
        Returns:
            :meth:`run`'s fields plus :func:`zoomr.evaluation.match.match_fields`' (``budget_tokens`` = B).
        Raises:
            ValueError: no budget is valid with the base policy's knobs (see ``predict_budget``).
            KeyboardInterrupt: as :meth:`run`.
        """
        spec = policy_spec(replace(self.opts, policy=self.plan.base_opts.policy))
        budget, simulated = predict_budget(spec, float(zoomr["mean_active_tokens"]), len(base_ids),
                                           int(zoomr["tokens_generated"]))
        rec = self.run(policy, budget, problem, base_ids, n_predict)
        kept = (f"single try at the B predicted for {matched_target()}'s lengths (a sampled cell: no selection "
                "between tries)")
        rec.update(match_fields(zoomr, budget, simulated, rec["mean_active_tokens"], 1, kept))
        return rec

    def memory(self, transcript: Transcript, uses_helper: bool) -> dict:
        """The base's KV figures and the method's totals of one run (bytes; see the module docstring)."""
        base, helper = transcript.trajectory_kv("base"), transcript.trajectory_kv("helper")
        end = transcript.kv["base"]
        base_peak = base["peak_active_tokens"] * _token_bytes(end)
        helper_mean = helper_peak = 0
        if uses_helper:
            helper_mean = helper["mean_active_bytes"]
            helper_peak = helper["peak_active_tokens"] * _token_bytes(transcript.kv["helper"])
        prm = self.scorer.kv_peak_bytes
        state_mean, state_peak = end["mean_policy_state_bytes"], end["policy_state_bytes"]
        method_mean = base["mean_active_bytes"] + state_mean + helper_mean + prm
        method_peak = base_peak + state_peak + helper_peak + prm
        return {
            "mean_active_tokens": base["mean_active_tokens"],
            "peak_active_tokens": base["peak_active_tokens"],
            "mean_active_bytes": base["mean_active_bytes"],
            "mean_full_bytes": base["mean_full_bytes"],
            "full_tokens": end["full_tokens"],
            "full_bytes": end["full_bytes"],
            "policy_state_bytes": state_peak,
            "mean_policy_state_bytes": state_mean,
            "helper_kv_bytes_mean": helper_mean,
            "helper_kv_bytes_peak": helper_peak,
            "prm_kv_bytes_peak": prm,
            "method_kv_bytes_mean": method_mean,
            "method_kv_bytes_peak": method_peak,
            "saving": round(base["mean_full_bytes"] / method_mean, 3) if method_mean else 1.0,
            "saving_peak": round(end["full_bytes"] / method_peak, 3) if method_peak else 1.0,
        }


def _token_bytes(kv: dict) -> int:
    """K+V bytes of one position of a model, from its KVStats dict (bytes)."""
    return kv["full_bytes"] // max(kv["full_tokens"], 1)


def active_trace(transcript: Transcript, prompt_tokens: int) -> list[list[int]]:
    """[[generated position, base active tokens], ...] along the committed trajectory: the prompt state,
    then each committed token where the value changes (a prefilled step shows as one jump)."""
    start = transcript.start.kv["base"]
    trace = [[start["full_tokens"] - prompt_tokens, start["active_tokens"]]]
    for active, _, full, _ in transcript.kv_series["base"]:
        point = [full - prompt_tokens, active]
        if point != trace[-1]:
            trace.append(point)
    return trace


def same_model(a, b) -> bool:
    """True when two :class:`zoomr.backends.models.ModelSource` are the same model file or directory."""
    return Path(a.path).resolve() == Path(b.path).resolve()


def rescue_warnings(items: list[dict]) -> list[str]:
    """One-line warnings about what the rescue comparison can show, for the lines under its table.

    Args:
        items: bench records (or rows that carry ``scorer`` and ``helper_is_base``); only those of the
            ``rescue`` and ``best-of-n`` cells are read.
    Returns:
        one line per problem found, in a fixed order: scored by the helper's likelihood with the helper =
        the base model (the comparison proves little); by the helper's likelihood otherwise (not a process
        reward); the helper is the base model under a PRM (more KV than full KV). [] when none applies.
    """
    seen = {(str(r.get("scorer", "")).split(":", 1)[0], bool(r.get("helper_is_base")))
            for r in items if r.get("policy") in RESCUE_CELLS}
    lines = []
    if ("likelihood", True) in seen:
        lines.append("rescue cells scored by the helper's likelihood with the helper = the base model: the "
                     "comparison proves little (give --helper a smaller model and --prm a process reward model)")
    if ("likelihood", False) in seen:
        lines.append("rescue cells scored by the helper's mean log-likelihood (no --prm): not a process reward, "
                     "it favours the helper's own steps")
    if ("prm", True) in seen:
        lines.append("the helper is the base model itself: rescue holds the base's full KV beside its evicted "
                     "one, more than full KV (see the method KV)")
    return lines


def scorer_note(scorer: str | None) -> str | None:
    """How a rescue cell's scorer reads in a table or plot: ``likelihood scorer, no PRM`` for the fallback
    (``likelihood:HELPER``), ``PRM <name>`` for ``prm:PATH``; None for no scorer (a cell that is no rescue cell).
    """
    if not scorer:
        return None
    kind, _, where = str(scorer).partition(":")
    if kind == "likelihood":
        return "likelihood scorer, no PRM"
    return f"PRM {Path(where).name or where}" if kind == "prm" else kind


def cell_label(policy: str, scorer: str | None = None) -> str:
    """A cell's name in tables and plots: the policy, and for the rescue cells their scorer, e.g.
    ``rescue (likelihood scorer, no PRM)`` or ``best-of-n (PRM Qwen2.5-Math-PRM-7B)``."""
    note = scorer_note(scorer) if policy in RESCUE_CELLS else None
    return f"{policy} ({note})" if note else policy


def rescue_rows(rows: list[dict]) -> list[dict]:
    """KV-Rescue's headline numbers per budget, from :func:`zoomr.evaluation.metrics.summarize` rows.

    The recovered fraction's A_full is the sampled full-KV reference (the ``full-best-of-n`` row: same
    sampling, seeds and candidates as rescue and best-of-N), never the greedy ``full`` row; without it the
    fraction is None (a bench still running).

    Fields: budget, scorer (:func:`scorer_note`), full_reference (``"sampled"``: what acc_full is),
    full_reference_cell (its cell, ``full-best-of-n``), acc_full (that cell's accuracy), acc_full_greedy (the
    bench's greedy full-KV cell, the fidelity reference: shown, in no fraction), acc_best_of_n, acc_rescue,
    recovered_fraction (None when A_full = best-of-N or a row is missing), helper_share, base_tokens_rescue,
    base_tokens_best_of_n, base_token_ratio (rescue / best-of-N), no_answer_at_cap_rescue,
    no_answer_at_cap_best_of_n (the rows' no_answer_at_cap_rate), method_kv_bytes_mean_rescue,
    method_kv_bytes_mean_best_of_n (bytes; None when the rows lack them).
    """
    by = {(r["policy"], r["budget"]): r for r in rows}
    sampled, greedy = by.get((FULL_BEST_OF_N, None)), by.get((REFERENCE, None))
    out = []
    for budget in dict.fromkeys(r["budget"] for r in rows if r["policy"] == RESCUE):
        res, bon = by[(RESCUE, budget)], by.get((BEST_OF_N, budget))
        acc_full = sampled["accuracy"] if sampled else None
        acc_bon = bon["accuracy"] if bon else None
        ratio = None
        if bon and bon.get("base_tokens"):
            ratio = res["base_tokens"] / bon["base_tokens"]
        out.append({
            "budget": budget,
            "scorer": scorer_note(res.get("scorer")),
            "full_reference": "sampled",
            "full_reference_cell": FULL_BEST_OF_N,
            "acc_full": acc_full,
            "acc_full_greedy": greedy["accuracy"] if greedy else None,
            "acc_best_of_n": acc_bon,
            "acc_rescue": res["accuracy"],
            "recovered_fraction": (None if acc_full is None or acc_bon is None
                                   else recovered_fraction(res["accuracy"], acc_bon, acc_full)),
            "helper_share": res.get("helper_share"),
            "base_tokens_rescue": res.get("base_tokens"),
            "base_tokens_best_of_n": bon.get("base_tokens") if bon else None,
            "base_token_ratio": ratio,
            "no_answer_at_cap_rescue": res["no_answer_at_cap_rate"],
            "no_answer_at_cap_best_of_n": bon["no_answer_at_cap_rate"] if bon else None,
            "method_kv_bytes_mean_rescue": res.get("method_kv_bytes_mean"),
            "method_kv_bytes_mean_best_of_n": bon.get("method_kv_bytes_mean") if bon else None,
        })
    return out
