"""The bench engine: accuracy, fidelity to full KV, memory and speed of KV policies on a math data set.

Two front doors, one engine: :func:`bench` (``zoomr.bench``, options named as :func:`zoomr.load`'s) and
:func:`run_bench` (a parsed :class:`~zoomr.options.RunOptions`, what ``zoomr bench`` calls). Each (problem,
policy, budget) cell is appended to ``<out>/records.jsonl`` the moment it finishes; ``resume`` skips every
cell already there, so a crash or ``kill -9`` loses at most the cell in flight. Nothing is printed: progress
goes to ``on_event`` as :mod:`zoomr.evaluation.bench_events`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from zoomr.factory import build_backend
from zoomr.kvstore.registry import REFERENCE, knob_flags, policy_names
from zoomr.options import RunOptions
from zoomr.rescue.plan import RescueOptions

from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.batching import check_parallel, run_cells
from zoomr.evaluation.bench_cells import problem_cells, run_matched, runs_later, target_record
from zoomr.evaluation.bench_finish import finish
from zoomr.evaluation.bench_log import check_provenance, open_log, remove_if_empty
from zoomr.evaluation.bench_plan import MATCHED, BenchPlan, plan_bench
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import Problem
from zoomr.evaluation.provenance import run_provenance
from zoomr.evaluation.records import RecordLog, record_key, write_config
from zoomr.evaluation.rescue_cells import BEST_OF_N, RESCUE, RescueCells

BENCH_N_PREDICT = 256  # zoomr bench's -n default: shorter than solve's, a bench runs many cells


def bench(model: str | None = None, *, policies: Sequence[str] | str | None = None,
          budgets: Sequence[int] | None = None, dataset: str = "gsm8k", limit: int | None = None,
          out: str | Path | None = None, resume: bool = False, match_budget: bool = False, fidelity: bool = True,
          n_parallel: int = 1, rescue: RescueOptions | None = None,
          on_record: Callable[[dict], None] | None = None,
          on_event: Callable[[ev.BenchEvent], None] | None = None, **options) -> dict:
    """Compare KV policies on a data set: what ``zoomr bench`` runs, from Python.

    Args:
        model: ``-m``: None for the embedded model, a ``.gguf`` path, a HF folder, an alias or a hub id.
        policies: names of :data:`zoomr.POLICIES` (or one comma-separated string); None: every policy.
        budgets: ``--budget`` values (tokens) for the budgeted policies; None: 64 (the knob's default).
        dataset: gsm8k, math500, aime24, amc23, olympiadbench, a JSONL path or a hub data set id.
        limit: the first N problems only; out: the output folder (default ``bench_out/<dataset>``).
        resume: skip the cells already in ``out/records.jsonl``.
        match_budget: every budgeted baseline gets the matched target's (ZoomR's) measured mean active KV as
            budget, per problem (``budgets`` must then be None).
        fidelity: measure teacher-forced fidelity to full KV (top-1 agreement, KL in nats/token).
        n_parallel: sequences decoded together in one batched forward (``-np``).
        rescue: KV-Rescue cells (and eviction-only best-of-N) at every budget, with these settings; None: none.
        on_record: called with each record the moment it is appended (fsynced) to ``records.jsonl``.
        on_event: called with every :class:`zoomr.evaluation.bench_events.BenchEvent`, on this thread.
        **options: :class:`zoomr.options.RunOptions` fields (``n_predict`` tokens, default 256; ``ctx_size``,
            ``dtype``, ``seed``, ``temp``, ``ignore_eos``, ...) and the policies' knobs named as their flags
            (``window``, ``segment_tokens``, ...: docs' policy table); each policy reads only its own knobs.
    Returns:
        the summary written to ``summary.json`` ({"config", "rows", and "rescue" when rescue cells ran: one
        row per (policy, budget), :func:`zoomr.evaluation.metrics.summarize`), plus "out" (the folder, a
        Path), "records" (every record of the folder), "plots" (PNG paths) and "warnings" (lines).
    Raises:
        TypeError: an unknown option, or ``budget`` (the budgets are ``budgets``).
        zoomr.errors.UserError: a bad policy list, budget, knob, option, data set or output folder, a prompt
            over ``ctx_size``; ValueError: a bad model (zoomr.backends.models.ModelNotFound) or data file.
        KeyboardInterrupt: the finished cells are kept, and ``summary.json`` holds them.
    """
    opts = bench_options(model, options)
    if isinstance(policies, str):
        policies = policies.split(",")
    names = policy_names() if policies is None else [p.strip() for p in policies]
    return run_bench(opts, names, budgets, dataset=dataset, limit=limit, out=out, resume=resume,
                     match_budget=match_budget, fidelity=fidelity, n_parallel=n_parallel,
                     rescue=None if rescue is None else replace(rescue, rescue=True), on_record=on_record,
                     on_event=on_event)


def bench_options(model: str | None, options: dict) -> RunOptions:
    """:func:`bench`'s ``**options`` as the :class:`RunOptions` ``zoomr bench`` would parse (its -n default).

    Raises:
        TypeError: an unknown option, or ``budget``.
    """
    if "budget" in options:
        raise TypeError("bench(): give the budgets as budgets=[...] (tokens), not budget=")
    known = {f.name for f in dataclasses.fields(RunOptions)} - {"model", "policy", "knobs"}
    flags = knob_flags()
    knobs = {k: options.pop(k) for k in list(options) if k in flags}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"bench() got unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))} "
                        "and the policies' knobs)")
    settings = {"n_predict": BENCH_N_PREDICT, **options}
    return RunOptions(model=model, **settings, knobs={k: v for k, v in knobs.items() if v is not None})


def run_bench(opts: RunOptions, policies: Sequence[str], budgets: Sequence[int] | None = None, *,
              dataset: str = "gsm8k", limit: int | None = None, out: str | Path | None = None, resume: bool = False,
              match_budget: bool = False, fidelity: bool = True, n_parallel: int = 1,
              rescue: RescueOptions | None = None, on_record: Callable[[dict], None] | None = None,
              on_event: Callable[[ev.BenchEvent], None] | None = None) -> dict:
    """:func:`bench` with its model settings already parsed into ``opts`` (``opts.policy`` and the budget are
    not read: the cells choose them). ``rescue``: None for no rescue cells. Returns and raises as :func:`bench`."""
    emit = on_event or (lambda event: None)
    plan = plan_bench(opts, policies, budgets, dataset=dataset, limit=limit, out=out, match_budget=match_budget,
                      fidelity=fidelity, n_parallel=n_parallel, rescue=rescue)
    for line in plan.scope:
        emit(ev.Info(line))
    warnings: list[str] = []
    out = plan.out
    new_folder = not out.exists()
    log = open_log(out, plan.config, resume)
    if resume and not log.records:
        # a mistyped --out would otherwise start a long run silently where the user meant to finish one
        warnings.append(f"--resume: {out} holds no bench records yet; starting a new run there")
        emit(ev.Warning(warnings[-1]))
    base = rescue_cells = None
    prompts: dict[str, list[int]] = {}
    try:
        if _left(plan, log):
            base, rescue_cells, prompts = _load_for(plan, log, emit)
    except BaseException:
        if new_folder:  # refused before anything ran (a model that cannot load, -np too large): leave no folder
            remove_if_empty(out)
        raise
    if base is not None:
        # only now, with every model loaded, does the folder take this run's settings
        write_config(out / "config.json", plan.config)
    done = sum(record_key(p.id, c, b) in log.done for p in plan.problems for c, b in plan.cells)
    emit(ev.BenchStarted(None if base is None else base.describe_model(), tuple(plan.policies), plan.rescue_base,
                         plan.dataset, len(plan.problems), out, len(plan.problems) * len(plan.cells), done,
                         log.records))
    try:
        _run_cells(plan, base, rescue_cells, prompts, log, on_record, emit)
    finally:
        result = finish(out, plan.config, log, emit, warnings)  # also after an error: whatever finished
    return result


def _left(plan: BenchPlan, log: RecordLog, problem: Problem | None = None) -> list:
    """The cells not recorded yet, of ``problem`` (else of every problem) as (problem, policy, budget)."""
    return [(p, c, b) for p in ([problem] if problem else plan.problems) for c, b in plan.cells
            if record_key(p.id, c, b) not in log.done]


@contextlib.contextmanager
def _loading(emit, what: str):
    """Announce a load as :class:`~zoomr.evaluation.bench_events.Loading`, and its end (also a failed one)."""
    emit(ev.Loading(what))
    try:
        yield
    finally:
        emit(ev.Loaded(what))


def _load_for(plan: BenchPlan, log: RecordLog, emit):
    """The models a bench with cells left to run needs, and the prompts of its problems with cells left.

    Returns:
        (base backend running full KV, the rescue cells' models or None, {problem id: prompt ids}).
    Raises:
        UserError / ValueError: a model that cannot load, a prompt over ``-c``, ``-np`` too large for memory.
    """
    opts, rescue_cells = plan.opts, None
    with _loading(emit, "model"):
        # the loaded backend runs full KV (the reference); every cell swaps in its own policy
        base = build_backend(replace(opts, policy=REFERENCE))
    if plan.rescue_plan is not None:
        with _loading(emit, "helper"):
            rescue_cells = RescueCells(base, opts, plan.rescue_plan, plan.factories)
    check_provenance(plan.config, run_provenance(base.source.path))
    # every prompt left to run fits -c (and is valid text), for each model that prefills it
    tokenizers = [base.tokenizer] + ([rescue_cells.helper.tokenizer] if rescue_cells is not None else [])
    prompts = {p.id: [problem_prompt(t, p, opts.ctx_size) for t in tokenizers][0] for p in plan.problems
               if _left(plan, log, p)}
    check_parallel(plan.n_parallel, base, max(map(len, prompts.values())), opts.n_predict)
    return base, rescue_cells, prompts


def _run_cells(plan: BenchPlan, base, rescue_cells, prompts: dict, log: RecordLog, on_record, emit) -> None:
    """Run every cell not recorded yet, appending each record as it finishes."""
    opts, golds = plan.opts, {p.id: p.gold for p in plan.problems}

    def record(key: tuple, fields: dict, budget_tokens) -> None:
        problem_id, policy, b = key
        if record_key(problem_id, policy, b) in log.done:
            return  # a reference rerun, recorded before
        log.append({"problem_id": problem_id, "policy": policy, "budget": b, "budget_tokens": budget_tokens,
                    "gold": golds[problem_id], **fields})
        if on_record is not None:
            on_record(log.records[-1])
        emit(ev.CellFinished(log.records[-1], log.records))

    later_kinds = any(runs_later(p, b) for p, b in plan.cells)
    # matched and rescue cells run one by one after their problem's batched cells (they need its matched
    # target's record and reference), so problems then go through the batch one at a time
    for chunk in ([[p] for p in plan.problems] if later_kinds else [plan.problems]):
        batch, later, references = [], {}, {}
        for problem in chunk:
            pending = [(c, b) for _, c, b in _left(plan, log, problem)]
            if pending:
                batch += problem_cells(base, opts, problem, prompts[problem.id], plan.sampling, pending,
                                       plan.fidelity, references if later_kinds else None, plan.factories)
                later[problem.id] = [(p, b) for p, b in pending if runs_later(p, b)]
        if batch:
            emit(ev.BatchStarted(len(batch), plan.n_parallel))
        run_cells(base, batch, plan.n_parallel, lambda c: record(c.key, c.fields(), c.key[2]))
        for problem in chunk:
            ids = prompts.get(problem.id)
            ref_job = references.get(problem.id)
            reference = None if ref_job is None else ref_job.reference
            for policy, b in later.get(problem.id, []):
                emit(ev.CellStarted(problem.id, policy, b))
                if policy in (RESCUE, BEST_OF_N) and b == MATCHED:
                    rec = rescue_cells.run_matched(policy, problem, ids, opts.n_predict,
                                                   target_record(log.records, problem.id))
                    budget_tokens = rec.pop("budget_tokens")
                elif policy in (RESCUE, BEST_OF_N):
                    budget_tokens = b
                    rec = rescue_cells.run(policy, b, problem, ids, opts.n_predict)
                else:
                    rec = run_matched(base, opts, policy, problem, ids, plan.sampling, reference,
                                      target_record(log.records, problem.id))
                    budget_tokens = rec.pop("budget_tokens")
                record((problem.id, policy, b), rec, budget_tokens)
