"""The work of a bench on loaded models: load what its cells need, then run the pending cells of some problems.

One implementation for both ways a bench runs: :func:`zoomr.evaluation.runner.run_bench` calls it once for
every problem in this process, a Ray worker (:mod:`zoomr.evaluation.ray_worker`) calls it per problem it is
handed. A problem is the unit of work because its matched-budget and rescue cells need its full-KV reference
run and its matched target's record, which stay in the process that made them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Container, Sequence

from zoomr.factory import build_backend
from zoomr.kvstore.registry import REFERENCE

from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.batching import check_parallel, run_cells
from zoomr.evaluation.bench_cells import problem_cells, run_matched, runs_later, target_record
from zoomr.evaluation.bench_plan import MATCHED, BenchPlan
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import Problem
from zoomr.evaluation.records import record_key
from zoomr.evaluation.rescue_cells import RESCUE_CELLS, RescueCells

# put(key, fields, budget_tokens): one finished cell, key = (problem id, policy, budget), fields its record's
Put = Callable[[tuple, dict, object], None]


@dataclass
class LoadedModels:
    """What a bench's cells run on.

    Attributes:
        base: the bench's model as a torch backend running full KV (each cell swaps in its own policy).
        rescue_cells: KV-Rescue's helper and scorer with the base (None: no rescue cells).
        prompts: {problem id: prompt token ids} for every problem with cells left.
    """

    base: object
    rescue_cells: RescueCells | None
    prompts: dict[str, list[int]]


def pending(plan: BenchPlan, done: Container, problem: Problem) -> list[tuple[str, object]]:
    """``problem``'s (policy, budget) cells whose record key is not in ``done``, in the plan's order."""
    return [(c, b) for c, b in plan.cells if record_key(problem.id, c, b) not in done]


@contextlib.contextmanager
def loading(emit, what: str):
    """Announce a load as :class:`~zoomr.evaluation.bench_events.Loading`, and its end (also a failed one)."""
    emit(ev.Loading(what))
    try:
        yield
    finally:
        emit(ev.Loading(what, ended=True))


def load_models(plan: BenchPlan, problems: Sequence[Problem], emit) -> LoadedModels:
    """Load the bench's model (and KV-Rescue's helper), and check every prompt of ``problems`` against them.

    Args:
        problems: the problems with cells left to run (their prompts are made and checked here).
        emit: receives :class:`~zoomr.evaluation.bench_events.Loading` at the start and end of each load.
    Raises:
        UserError / ValueError: a model that cannot load, a prompt over ``-c``, ``-np`` too large for memory.
    """
    opts, rescue_cells = plan.opts, None
    with loading(emit, "model"):
        base = build_backend(replace(opts, policy=REFERENCE))
    if plan.rescue_plan is not None:
        with loading(emit, "helper"):
            rescue_cells = RescueCells(base, opts, plan.rescue_plan, plan.factories)
    # every prompt left to run fits -c (and is valid text), for each model that prefills it
    tokenizers = [base.tokenizer] + ([rescue_cells.helper.tokenizer] if rescue_cells is not None else [])
    prompts = {p.id: [problem_prompt(t, p, opts.ctx_size) for t in tokenizers][0] for p in problems}
    if prompts:
        check_parallel(plan.n_parallel, base, max(map(len, prompts.values())), opts.n_predict)
    return LoadedModels(base, rescue_cells, prompts)


def run_problems(plan: BenchPlan, models: LoadedModels, problems: Sequence[Problem], done: Container,
                 records: list[dict], put: Put, emit) -> None:
    """Run the cells of ``problems`` whose key is not in ``done``, calling ``put`` as each one finishes.

    Plain cells of all the problems share one continuous batch (``-np``); when matched-budget or rescue cells
    are planned, problems go one at a time, each one's batch first, then its matched and rescue cells alone
    (they need the batch's full-KV reference and matched target's record).

    Args:
        done: record keys (:func:`zoomr.evaluation.records.record_key`) already recorded.
        records: the records so far, read for a problem's matched target: ``put`` must append each new record
            to it (or to the list it is a view of) before returning.
        put: receives (key, record fields, budget in tokens) per finished cell; a full-KV reference run again
            for fidelity is put again too (the caller drops keys it holds).
        emit: receives :class:`~zoomr.evaluation.bench_events.BatchStarted` and ``CellStarted``.
    Raises:
        whatever a cell raises (UserError for an out-of-range matched budget, RuntimeError on a device fault).
    """
    opts, base, rescue_cells = plan.opts, models.base, models.rescue_cells
    later_kinds = any(runs_later(p, b) for p, b in plan.cells)
    for chunk in ([[p] for p in problems] if later_kinds else [list(problems)]):
        batch, later, references = [], {}, {}
        for problem in chunk:
            cells = pending(plan, done, problem)
            if cells:
                batch += problem_cells(base, opts, problem, models.prompts[problem.id], plan.sampling, cells,
                                       plan.fidelity, references if later_kinds else None, plan.factories)
                later[problem.id] = [(p, b) for p, b in cells if runs_later(p, b)]
        if batch:
            emit(ev.BatchStarted(len(batch), plan.n_parallel))
        run_cells(base, batch, plan.n_parallel, lambda c: put(c.key, c.fields(), c.key[2]))
        for problem in chunk:
            ids = models.prompts.get(problem.id)
            ref_job = references.get(problem.id)
            reference = None if ref_job is None else ref_job.reference
            for policy, b in later.get(problem.id, []):
                emit(ev.CellStarted(problem.id, policy, b))
                if policy in RESCUE_CELLS and b == MATCHED:
                    rec = rescue_cells.run_matched(policy, problem, ids, opts.n_predict,
                                                   target_record(records, problem.id, plan.target))
                    budget_tokens = rec.pop("budget_tokens")
                elif policy in RESCUE_CELLS:
                    budget_tokens = b
                    rec = rescue_cells.run(policy, b, problem, ids, opts.n_predict)
                else:
                    rec = run_matched(base, opts, policy, problem, ids, plan.sampling, reference,
                                      target_record(records, problem.id, plan.target))
                    budget_tokens = rec.pop("budget_tokens")
                put((problem.id, policy, b), rec, budget_tokens)
