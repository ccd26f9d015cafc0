"""One problem's bench cells as runs: the batched ones (full KV, the fidelity reference, then each policy with
its fidelity pass) and the matched-budget ones, whose budget follows the matched target's measured KV."""

from __future__ import annotations


from zoomr.errors import UserError
from zoomr.factory import policy_spec, with_policy
from zoomr.kvstore.registry import REFERENCE, matched_target, policy_info
from zoomr.options import RunOptions

from zoomr.evaluation.batching import CellRun, FidelityJob, GenerationJob, run_cell, teacher_forced_fidelity
from zoomr.evaluation.match import TOLERANCE, match_error, match_fields, predict_budget
from zoomr.evaluation.records import FULL_BEST_OF_N, MATCHED, RESCUE_CELLS
from zoomr.evaluation.variants import is_variant_label, parse_variant


def runs_later(policy: str, budget) -> bool:
    """Whether cell (policy, budget) runs alone after its problem's batch: a matched-budget or rescue cell
    needs the matched target's record (and full KV's reference) of the same problem first."""
    return policy in RESCUE_CELLS or budget == MATCHED


def cell_policy(name: str, budget, rescue_base: str | None = None) -> tuple[str, int | str | None] | None:
    """The policy a cell builds and the budget knob it gets: (its label, budget in tokens, :data:`MATCHED`, or
    None for a policy that sizes itself); a rescue cell builds its base policy, full-best-of-n full KV. The label
    is a policy or a variant of one (``zoomr:window=256``, :mod:`zoomr.evaluation.variants`). None: a rescue
    cell without a base.

    Raises:
        ValueError / UserError: an unknown policy or variant.
    """
    label = REFERENCE if name == FULL_BEST_OF_N else name if is_variant_label(name) else rescue_base
    if label is None:
        return None
    return label, (budget if budget is not None and policy_info(parse_variant(label).policy).budgeted else None)


def problem_cells(base, opts: RunOptions, problem, ids: list[int], sampling, pending: list, fidelity: bool,
                  references: dict | None, factories: dict) -> list[CellRun]:
    """The batched cells of one problem still to run: full KV first (made again, unrecorded, when it is
    recorded but other cells need it as their fidelity reference), then each plain cell with its fidelity pass.

    Args:
        base: the bench's full-KV torch backend; ids: the problem's prompt (token ids).
        pending: the problem's (policy, budget) cells not recorded yet; matched and rescue cells among them
            are left to the caller (:func:`runs_later`).
        references: full KV's job goes into ``references[problem.id]``; None: no caller needs it after the
            batch, so its logits are released as soon as fidelity is done.
        factories: {(policy, budget): cache factory} as :func:`zoomr.evaluation.bench_plan.validate_cells`
            built them: every problem's view reuses its cell's (no policy is built again here).
    """
    plain = [(p, b) for p, b in pending if not runs_later(p, b)]
    # the full-KV run is the yardstick of every other cell: rerun it if it is already recorded
    want_ref = fidelity and any(p != REFERENCE and p not in RESCUE_CELLS for p, _ in pending)
    runs = []
    full = None
    if want_ref or (REFERENCE, None) in plain:
        view = base.with_cache_factory(factories[(REFERENCE, None)])
        full = GenerationJob(view, problem, ids, sampling, opts.n_predict, keep_logits=want_ref,
                             ignore_eos=opts.ignore_eos, hold_reference=references is not None)
        runs.append(CellRun((problem.id, REFERENCE, None), full))  # recorded only when not yet done
        if references is not None:
            references[problem.id] = full
    for policy, b in plain:
        if policy == REFERENCE:
            continue
        view = base.with_cache_factory(factories[(policy, b)])
        gen = GenerationJob(view, problem, ids, sampling, opts.n_predict, ignore_eos=opts.ignore_eos)
        runs.append(CellRun((problem.id, policy, b), gen, FidelityJob(view, ids, full) if want_ref else None))
    return runs


def target_record(records: list[dict], problem_id: str, target: str | None = None) -> dict:
    """The matched target's (:func:`zoomr.kvstore.registry.matched_target`, ZoomR) record of this problem: its
    measured mean active KV is what the matched baselines aim at.

    Args:
        target: the target cell's label (``zoomr:window=256`` when that variant is the first ZoomR cell of the
            bench, :attr:`zoomr.evaluation.bench_plan.BenchPlan.target`); None: the plain policy.
    Raises:
        UserError: it is not recorded yet (the bench runs it before the matched cells).
    """
    target = target or matched_target()
    for r in records:
        if r["problem_id"] == problem_id and r["policy"] == target:
            return r
    raise UserError(f"internal order error: {target} must run before the matched baselines")


def run_matched(base, opts: RunOptions, policy: str, problem, ids: list[int], sampling, reference,
                target: dict) -> dict:
    """One matched-budget cell: predict B, run, check the measured mean against the target's (see
    :mod:`zoomr.evaluation.match`).

    Args:
        base: the bench's full-KV torch backend; ``policy``: an evicting baseline (a cell label: a policy or
            a variant of one with its own knobs).
        reference: full KV's run for fidelity (None: no fidelity), measured on the run kept.
        target: the matched target's record of the same problem (``mean_active_tokens``, ``tokens_generated``;
            :func:`target_record`).
    Returns:
        the record fields of the last run (at most two; the second, when it runs, is kept whatever its
        error: choosing the closer would select on output length), plus
        :func:`zoomr.evaluation.match.match_fields`' (``budget_tokens`` = B, ``match_runs``, ``match_kept``).
    Raises:
        ValueError: no budget is valid with the policy's knobs (see ``predict_budget``).
    """
    mean, n = float(target["mean_active_tokens"]), int(target["tokens_generated"])
    cell = parse_variant(policy).options(opts)
    spec = policy_spec(cell)
    budget, simulated = predict_budget(spec, mean, len(ids), n)
    runs = 0
    while True:
        view = with_policy(base, cell.with_knobs(budget=budget))
        rec = run_cell(view, problem, ids, sampling, opts.n_predict, ignore_eos=opts.ignore_eos)
        runs += 1
        if runs == 2:
            kept = f"second try, B predicted at the first's length ({n} tokens): the last is kept, never the closer"
            break
        if abs(match_error(rec["mean_active_tokens"], mean)) <= TOLERANCE:
            kept = f"first try, within ±{TOLERANCE:.0%}"
            break
        if rec["tokens_generated"] == n:
            kept = f"first try, {matched_target()}'s length: a second try would get the same B"
            break
        # the baseline wrote a different length than the target: predict again at its own length
        n = rec["tokens_generated"]
        again, simulated_again = predict_budget(spec, mean, len(ids), n)
        if again == budget:
            kept = f"first try: B predicted at its own length ({n} tokens) is the same"
            break
        budget, simulated = again, simulated_again
    if reference is not None:
        rec.update(teacher_forced_fidelity(view, ids, reference))
    rec.update(match_fields(target, budget, simulated, rec["mean_active_tokens"], runs, kept))
    return rec
