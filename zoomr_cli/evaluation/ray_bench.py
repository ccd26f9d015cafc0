"""``zoomr bench --ray``: the bench's problems sharded over Ray actors, on one machine or a cluster.

The driver (this process) is the bench's only writer, holding the folder's lock for the whole run
(:mod:`zoomr.evaluation.folder_lock`, taken by the runner before the workers start): workers
(:class:`~zoomr.evaluation.ray_worker.BenchWorker` actors, one per GPU or per ``-t`` CPU threads) load the
models once and stream each finished cell back; the driver appends it to ``records.jsonl`` (fsynced, deduplicated by record key), draws progress and writes the
summary. Whole problems are the unit of work (a problem's matched and fidelity cells need its full-KV
reference run, which stays on the worker that made it), handed out longest-expected-first as workers free
up. A worker that dies has its unit's unfinished cells handed to another; Ctrl-C kills the workers and keeps
every finished record. Ray is an optional dependency (``pip install 'zoomr[ray]'``), imported only by
:mod:`zoomr.evaluation.ray_cluster` and only when asked for.
Sources: Ray's actor and streaming-generator APIs (docs.ray.io, "Ray Generators"); lm-evaluation-harness's
vLLM data-parallel path and R-KV's data parallelism shard the same way (one model replica per GPU).
"""

from __future__ import annotations

import collections
import os
from dataclasses import replace
from pathlib import Path

from zoomr.errors import UserError

from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.bench_cells import runs_later
from zoomr.evaluation.bench_plan import BenchPlan
from zoomr.evaluation.bench_units import Put, pending
from zoomr.evaluation.ray_cluster import check_address, connect, first_line, import_ray, quiet, slots
from zoomr.evaluation.records import RecordLog
from zoomr.evaluation.rescue_cells import RESCUE_CELLS

ATTEMPTS = 3              # a unit whose worker died this many times stops the bench (it kills workers)


def expected_cost(plan: BenchPlan, cells: list, prompt_tokens: int) -> float:
    """A problem's expected work (token positions to run), to hand the longest out first: each cell decodes
    up to ``-n`` after its prompt; a matched cell may run twice, a rescue cell runs several candidates."""
    n = plan.opts.n_predict if plan.opts.n_predict > 0 else plan.opts.ctx_size
    weight = sum(3 if p in RESCUE_CELLS else 2 if runs_later(p, b) else 1 for p, b in cells)
    return weight * (prompt_tokens + n)


def units(plan: BenchPlan, problems: list, cost: dict, workers: int) -> list[list]:
    """The problems in units of work, the most expected work first (``cost``: {problem id: expected_cost}).

    A unit is one problem when matched-budget or rescue cells are planned (a local bench runs those problems
    one at a time too). Otherwise a unit holds up to enough problems to fill a ``-np`` batch twice, so the
    batch's drain at the unit's end is a small part of it, sized so the units split evenly over the workers.
    """
    ranked = sorted(problems, key=lambda p: -cost[p.id])
    if any(runs_later(p, b) for p, b in plan.cells):
        return [[p] for p in ranked]
    # sequences one problem puts in a batch: each plain cell's generation, plus a fidelity pass per evicting one
    per_problem = len(plan.cells) + (len(plan.cells) - 1 if plan.fidelity else 0)
    size = max(1, min(-(-2 * plan.n_parallel // per_problem), -(-len(ranked) // workers)))
    # as many units as a whole number of rounds over the workers needs, evened out: 8 problems, 2 workers and
    # units of 3 would leave one worker 2 problems behind; four units of 2 do not
    rounds = -(-len(ranked) // (workers * size))
    size = -(-len(ranked) // (workers * rounds))
    return [ranked[i:i + size] for i in range(0, len(ranked), size)]


class RayBench:
    """A bench's Ray workers, from connection to shutdown. Made before the output folder (bad input costs
    nothing), started once the folder is open, stopped in every case.

    Args:
        address: ``--ray``: ``auto`` or a cluster address (:func:`zoomr.evaluation.ray_cluster.check_address`).
        workers: ``--ray-workers`` (None: one per slot, see :func:`zoomr.evaluation.ray_cluster.slots`).
    Raises:
        UserError: Ray missing, a bad address, fewer than one worker.
    """

    def __init__(self, address: str, workers: int | None = None):
        if workers is not None and workers < 1:
            raise UserError(f"--ray-workers must be >= 1, got {workers}")
        self.ray = import_ray()
        self.address = check_address(address)
        self.actors: list = []
        self.info: dict = {}       # actor -> what its load() returned
        self.workers, self.started = workers, False

    def start(self, plan: BenchPlan, problems: list, emit) -> list[dict]:
        """Connect (or start a local Ray), start the workers and load the models on each.

        Args:
            problems: the problems with cells left (each worker checks their prompts).
        Returns:
            each worker's {"host", "pid", "device", "model", "provenance", "prompt_tokens"}.
        Raises:
            UserError / ValueError: what loading the model raises on a worker; UserError: workers that do not fit,
                workers that disagree on the model file.
        """
        ray = self.ray
        if not ray.is_initialized():   # a library caller's own ray.init is used as it is, and left running
            self.started = True   # before connecting: a Ctrl-C inside ray.init still gets ray.shutdown()
            connect(ray, self.address)
        n, ask, threads = slots(ray, plan, self.workers)
        model = plan.opts.model
        if model and Path(model).expanduser().exists():   # a worker's working folder is not ours
            model = str(Path(model).expanduser().resolve())
        plan = replace(plan, opts=replace(plan.opts, model=model, threads=threads))
        env = {k: v for k, v in os.environ.items() if k.startswith(("ZOOMR_", "HF_"))}
        actor = ray.remote(max_restarts=0)(_worker_class())
        opts = {**ask, **({"runtime_env": {"env_vars": env}} if env and self.address else {})}
        self.actors = [actor.options(**opts).remote(plan) for _ in range(n)]
        ids = [p.id for p in problems]
        infos = self._get([a.load.remote(ids) for a in self.actors])
        self.info = dict(zip(self.actors, infos))
        shas = {i["provenance"].get("model_sha256") for i in infos}
        if len(shas) > 1:
            raise UserError("--ray: the workers' model files differ (sha256 " + ", ".join(sorted(map(str, shas)))
                            + "); install the same file on every host")
        for k, i in enumerate(infos, 1):
            emit(ev.Info(f"ray worker {k}/{n}: {i['host']} pid {i['pid']} · {i['device']}"))
        return infos

    def run(self, plan: BenchPlan, log: RecordLog, record: Put, emit) -> None:
        """Hand out the problems with cells left until every cell is recorded; ``record`` writes each one.

        Raises:
            RuntimeError: every worker died, or one problem's worker died :data:`ATTEMPTS` times.
            UserError / ValueError: a cell's error on a worker, as it would be raised here.
        """
        ray, tokens = self.ray, next(iter(self.info.values()))["prompt_tokens"]
        left = [p for p in plan.problems if pending(plan, log.done, p)]
        cost = {p.id: expected_cost(plan, pending(plan, log.done, p), tokens.get(p.id, 0)) for p in left}
        todo, free, flight = collections.deque(units(plan, left, cost, len(self.actors))), list(self.actors), {}
        attempts = collections.Counter()
        while todo or flight:
            while todo and free:
                unit = [p for p in todo.popleft() if pending(plan, log.done, p)]
                if not unit:
                    continue
                actor, ids = free.pop(0), {p.id for p in unit}
                done = [k for k in log.done if k[0] in ids]
                mine = [r for r in log.records if r["problem_id"] in ids]
                flight[actor.run.remote([p.id for p in unit], done, mine)] = (actor, unit)
            if not flight:
                break
            ready, _ = ray.wait(list(flight), num_returns=1)
            gen = ready[0]
            actor, unit = flight[gen]
            try:
                item = ray.get(next(gen))
            except StopIteration:
                del flight[gen]
                free.append(actor)
                continue
            except ray.exceptions.RayActorError as e:
                del flight[gen]
                key = tuple(p.id for p in unit)
                attempts[key] += 1
                self._lost(actor, unit, e, attempts[key], emit)
                todo.appendleft(unit)
                continue
            except ray.exceptions.RayTaskError as e:
                raise _unwrapped(e) from None
            if item[0] == "record":
                _, key, fields, budget_tokens = item
                who = self.info[actor]
                record(key, {**fields, "worker_host": who["host"], "worker_pid": who["pid"]}, budget_tokens)
            else:
                emit(item[1])

    def _lost(self, actor, unit: list, error, attempts: int, emit) -> None:
        """Forget a dead worker; its problems go back to the queue unless they have killed too many."""
        who = self.info.pop(actor, {"host": "?", "pid": "?"})
        self.actors.remove(actor)
        with quiet():
            self.ray.kill(actor)
        reason = first_line(error)
        names = ", ".join(p.id for p in unit)
        emit(ev.Warning(f"ray worker {who['host']} pid {who['pid']} died ({reason}); the unfinished cells of "
                        f"problem(s) {names} go to {'another worker' if self.actors else 'nobody'}"))
        if not self.actors:
            raise RuntimeError("every Ray worker died; the finished cells are kept: --resume runs the rest")
        if attempts >= ATTEMPTS:
            raise RuntimeError(f"problem(s) {names}: their worker died {attempts} times; the finished cells are "
                               "kept (--limit or a smaller -np may avoid what kills it)")

    def stop(self) -> None:
        """Kill the workers, and the Ray instance this bench started (not one the caller had)."""
        with quiet():
            for actor in self.actors:
                self.ray.kill(actor)
            self.actors = []
            if self.started:
                self.ray.shutdown()
                self.started = False

    def _get(self, refs: list):
        """``ray.get`` of the workers' loads. Raises: their errors as ours (:func:`_unwrapped`); RuntimeError
        when a worker died before it answered (out of memory while loading, killed)."""
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as e:
            raise _unwrapped(e) from None
        except self.ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a Ray worker died while loading the model ({first_line(e)})") from None


def _unwrapped(error) -> BaseException:
    """A worker's exception as the driver raises it: ours (UserError, ValueError) as it was raised there."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, (UserError, ValueError, KeyboardInterrupt)):
        return cause
    return RuntimeError(f"a Ray worker failed: {type(cause).__name__ if cause else 'error'}: {cause or error}")


def _worker_class():
    from zoomr.evaluation.ray_worker import BenchWorker
    return BenchWorker
