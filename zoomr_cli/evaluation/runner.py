"""The bench engine: accuracy, fidelity to full KV, memory and speed of KV policies on a math data set.

Two front doors, one engine: :func:`bench` (``zoomr.bench``, options named as :func:`zoomr.load`'s) and
:func:`run_bench` (a parsed :class:`~zoomr.options.RunOptions`, what ``zoomr bench`` calls). Each (problem,
policy, budget) cell is appended to ``<out>/records.jsonl`` the moment it finishes; ``resume`` skips every
cell already there, so a crash or ``kill -9`` loses at most the cell in flight. Nothing is printed: progress
goes to ``on_event`` as :mod:`zoomr.evaluation.bench_events`. A run holds its folder's lock from before it
reads the records to after the summary (:mod:`zoomr.evaluation.folder_lock`): a second run on the same folder,
``--resume`` or not, stops before its first cell.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from zoomr.errors import UserError
from zoomr.kvstore.registry import knob_flags, policy_names
from zoomr.options import RunOptions
from zoomr.rescue.plan import RescueOptions

from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.bench_finish import finish
from zoomr.evaluation.bench_log import check_provenance, open_log, remove_if_empty
from zoomr.evaluation.bench_plan import BenchPlan, plan_bench
from zoomr.evaluation.bench_units import Put, load_models, loading, pending, run_problems
from zoomr.evaluation.datasets import Problem
from zoomr.evaluation.provenance import run_provenance
from zoomr.evaluation.ray_bench import RayBench
from zoomr.evaluation.records import RecordLog, record_key, write_config
from zoomr.evaluation.variants import cell_knob_fields

BENCH_N_PREDICT = 256  # zoomr bench's -n default: shorter than solve's, a bench runs many cells


def bench(model: str | None = None, *, policies: Sequence[str] | str | None = None,
          budgets: Sequence[int] | None = None, dataset: str = "gsm8k", limit: int | None = None,
          out: str | Path | None = None, resume: bool = False, match_budget: bool = False, fidelity: bool = True,
          n_parallel: int = 1, rescue: RescueOptions | None = None,
          on_record: Callable[[dict], None] | None = None,
          on_event: Callable[[ev.BenchEvent], None] | None = None, ray: str | None = None,
          ray_workers: int | None = None, **options) -> dict:
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
        ray: run the cells on Ray workers (:mod:`zoomr.evaluation.ray_bench`): ``"auto"`` starts a local Ray
            instance, ``"HOST:PORT"`` or ``"ray://HOST:PORT"`` joins a running cluster (or the one this process
            already joined with ``ray.init``); None: in this process. Records equal a local run's under greedy
            fp32, plus ``worker_host`` and ``worker_pid``; this process stays the only writer.
        ray_workers: Ray workers to start (None: one per GPU, else one per ``threads`` CPUs, 1 thread each
            when ``threads`` is not given).
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
            over ``ctx_size``; ``ray`` without Ray installed, an address nobody answers at, more workers than
            the cluster fits; ValueError: a bad model (zoomr.backends.models.ModelNotFound) or data file.
        zoomr.evaluation.folder_lock.FolderBusy (a UserError): another bench (of any process, this one
            included) is writing into ``out``; raised before any cell runs, naming its pid and host.
        KeyboardInterrupt: the finished cells are kept, and ``summary.json`` holds them.
    """
    opts = bench_options(model, options)
    if isinstance(policies, str):
        policies = policies.split(",")
    names = policy_names() if policies is None else [p.strip() for p in policies]
    return run_bench(opts, names, budgets, dataset=dataset, limit=limit, out=out, resume=resume,
                     match_budget=match_budget, fidelity=fidelity, n_parallel=n_parallel,
                     rescue=None if rescue is None else replace(rescue, rescue=True), on_record=on_record,
                     on_event=on_event, ray=ray, ray_workers=ray_workers)


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
              on_event: Callable[[ev.BenchEvent], None] | None = None, ray: str | None = None,
              ray_workers: int | None = None) -> dict:
    """:func:`bench` with its model settings already parsed into ``opts`` (``opts.policy`` and the budget are
    not read: the cells choose them). ``rescue``: None for no rescue cells. Returns and raises as :func:`bench`."""
    emit = on_event or (lambda event: None)
    if ray_workers is not None and ray is None:
        raise UserError("--ray-workers sets the workers of a Ray bench: add --ray auto (or a cluster's address)")
    plan = plan_bench(opts, policies, budgets, dataset=dataset, limit=limit, out=out, match_budget=match_budget,
                      fidelity=fidelity, n_parallel=n_parallel, rescue=rescue)
    # Ray's presence and the cluster's address are checked before the output folder is touched
    cluster = None if ray is None else RayBench(ray, ray_workers)
    for line in plan.scope:
        emit(ev.Info(line))
    warnings: list[str] = []
    out = plan.out
    new_folder = not out.exists()
    log, lock = open_log(out, plan.config, resume)   # held to the end: this run is the folder's one writer
    ran = False
    try:
        for line in ([lock.note] if lock.note else []) + log.notes():
            warnings.append(line)
            emit(ev.Warning(line))
        if resume and not log.records:
            # a mistyped --out would otherwise start a long run silently where the user meant to finish one
            warnings.append(f"--resume: {out} holds no bench records yet; starting a new run there")
            emit(ev.Warning(warnings[-1]))
        models, describe, workers = None, None, []
        left = _left(plan, log)
        try:
            if left:
                models, describe, workers = _load(plan, left, cluster, emit)
        except BaseException:
            if cluster is not None:
                cluster.stop()
            raise
        ran = True
        if left:
            if workers:   # where each cell ran: records name the worker, config.json says what each one was
                plan.config["workers"] = [{k: w[k] for k in ("host", "pid", "device", "provenance")} for w in workers]
            # only now, with every model loaded, does the folder take this run's settings
            write_config(out / "config.json", plan.config)
        done = sum(record_key(p.id, c, b) in log.done for p in plan.problems for c, b in plan.cells)
        emit(ev.BenchStarted(describe, tuple(plan.policies), plan.rescue_base, plan.dataset, len(plan.problems),
                             out, len(plan.problems) * len(plan.cells), done, log.records))
        record = _recorder(plan, log, on_record, emit)
        try:
            if left and cluster is not None:
                cluster.run(plan, log, record, emit)
            elif left:
                run_problems(plan, models, left, log.done, log.records, record, emit)
        finally:
            if cluster is not None:
                cluster.stop()
            result = finish(out, plan.config, log, emit, warnings)  # also after an error: whatever finished
        return result
    finally:
        lock.release()
        if new_folder and not ran:  # refused before anything ran (a model that cannot load, -np too large)
            remove_if_empty(out)


def _load(plan: BenchPlan, left: list[Problem], cluster: RayBench | None, emit):
    """Load the models here, or start the Ray workers that load them, and record the run's provenance.

    Returns:
        (the models loaded here or None, the model line, each Ray worker's description or []).
    Raises:
        UserError / ValueError: as :func:`zoomr.evaluation.bench_units.load_models` and :meth:`RayBench.start`;
            UserError: a resumed run's model file differs.
    """
    models, workers = None, []
    if cluster is not None:
        with loading(emit, "model"):
            workers = cluster.start(plan, left, emit)
        plural = "s" if len(workers) > 1 else ""
        describe, provenance = f"{workers[0]['model']} · {len(workers)} Ray worker{plural}", workers[0]["provenance"]
    else:
        models = load_models(plan, left, emit)
        describe, provenance = models.base.describe_model(), run_provenance(models.base.source.path)
    # the model line says what "auto" resolved to on this machine (--quant auto → ggml or int4, the dtype): the
    # settings alone do not say which kernels produced the records
    check_provenance(plan.config, {**provenance, "model_line": describe})
    return models, describe, workers


def _left(plan: BenchPlan, log: RecordLog) -> list[Problem]:
    """The problems with cells not recorded yet, in the plan's order."""
    return [p for p in plan.problems if pending(plan, log.done, p)]


def _recorder(plan: BenchPlan, log: RecordLog, on_record, emit) -> Put:
    """The one writer of ``records.jsonl``: each finished cell becomes a record, appended and fsynced once
    (a key already there, such as full KV run again as a fidelity reference, is dropped)."""
    golds = {p.id: p.gold for p in plan.problems}

    def record(key: tuple, fields: dict, budget_tokens) -> None:
        problem_id, policy, b = key
        if record_key(problem_id, policy, b) in log.done:
            return
        log.append({"problem_id": problem_id, "policy": policy, **cell_knob_fields(policy), "budget": b,
                    "budget_tokens": budget_tokens, "gold": golds[problem_id], **fields})
        if on_record is not None:
            on_record(log.records[-1])
        emit(ev.CellFinished(log.records[-1], log.records))
    return record
