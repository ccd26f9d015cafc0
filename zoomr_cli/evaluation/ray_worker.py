"""A Ray worker of ``zoomr bench --ray``: loads the bench's models once, then runs the problems it is handed.

The class is plain Python (this module imports no Ray): :mod:`zoomr.evaluation.ray_bench` makes it an actor
with ``ray.remote``. The worker writes nothing: each finished cell goes back to the driver, the only writer of
``records.jsonl``, through Ray's streaming generator, the moment it finishes.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from typing import Iterator

from zoomr.evaluation.bench_plan import BenchPlan
from zoomr.evaluation.bench_units import load_models, run_problems
from zoomr.evaluation.provenance import run_provenance


class BenchWorker:
    """One slot of a Ray bench (one GPU, or ``-t`` CPU threads), holding the bench's models.

    Args:
        plan: the driver's checked plan (problems, cells, each cell's cache factory, options).
    """

    def __init__(self, plan: BenchPlan):
        self.plan = plan
        self.models = None

    def load(self, problem_ids: list[str]) -> dict:
        """Load the models and check the prompts of ``problem_ids`` (those with cells left).

        Returns:
            {"host", "pid", "device", "model" (the model line), "provenance" (for ``config.json``),
            "prompt_tokens": {problem id: prompt length in tokens}}.
        Raises:
            UserError / ValueError: as :func:`zoomr.evaluation.bench_units.load_models` (Ray hands them to the
                driver wrapped in ``RayTaskError``).
        """
        wanted = set(problem_ids)
        self.models = load_models(self.plan, [p for p in self.plan.problems if p.id in wanted], lambda e: None)
        base = self.models.base
        return {"host": socket.gethostname(), "pid": os.getpid(), "device": str(getattr(base, "device", "cpu")),
                "model": base.describe_model(), "provenance": run_provenance(base.source.path),
                "prompt_tokens": {k: len(v) for k, v in self.models.prompts.items()}}

    def run(self, problem_ids: list[str], done: list[tuple], records: list[dict]) -> Iterator[tuple]:
        """Run the cells of ``problem_ids`` not in ``done`` (as a local bench runs them: one batch, or one problem
        at a time when matched or rescue cells are planned); a generator, so Ray streams each item as it happens.

        Args:
            done: record keys already recorded for these problems; records: their records so far (a problem's
                matched target's is read by its matched-budget cells).
        Yields:
            ("record", key, fields, budget_tokens) per finished cell, ("event", BenchEvent) per batch or lone
            cell started.
        Raises:
            whatever the cells raise (see :func:`zoomr.evaluation.bench_units.run_problems`).
        """
        wanted = set(problem_ids)
        problems = [p for p in self.plan.problems if p.id in wanted]
        items: queue.Queue = queue.Queue()
        records = list(records)

        def put(key: tuple, fields: dict, budget_tokens) -> None:
            records.append({"problem_id": key[0], "policy": key[1], "budget": key[2], **fields})
            items.put(("record", key, fields, budget_tokens))

        def work() -> None:
            try:
                run_problems(self.plan, self.models, problems, set(map(tuple, done)), records, put,
                             lambda event: items.put(("event", event)))
                items.put(("end",))
            except BaseException as e:  # handed to the generator, which raises it in Ray's task
                items.put(("error", e))

        # the cells report through callbacks; a thread turns them into this generator's yields as they come
        threading.Thread(target=work, name="bench-unit", daemon=True).start()
        while True:
            item = items.get()
            if item[0] == "end":
                return
            if item[0] == "error":
                raise item[1]
            yield item
