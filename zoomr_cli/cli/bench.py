"""``zoomr bench``: accuracy, fidelity to full KV, memory and speed of KV policies on a math data set.

Each (problem, policy, budget) cell is appended to ``records.jsonl`` the moment it finishes; ``--resume``
skips every cell already there, so a crash or ``kill -9`` loses at most the cell in flight.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from zoomr.errors import UserError
from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.datasets import list_datasets
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.records import MATCHED
from zoomr.evaluation.runner import BENCH_N_PREDICT, run_bench
from zoomr.kvstore.registry import matched_target, policy_names
from zoomr.options import RunOptions
from zoomr.rescue.plan import RescueOptions
from zoomr.cli.options import loading, model_options
from zoomr.cli.bench_tables import grid, main_table, match_table, memory_table, rescue_table
from zoomr.cli.render import Output, count
from zoomr.cli.rescue_options import rescue_options


def bench(
    budget: Annotated[Optional[list[int]], typer.Option("--budget", help="KV budget B (tokens); repeat for several (default 64).")] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policies to compare; a policy may carry knobs of its own "
                                          "for its cell alone, over the bench-wide flags: zoomr:window=256, "
                                          "zoomr:window=128:segment-tokens=64 (the same policy may run with several).")] = ",".join(policy_names()),
    dataset: Annotated[str, typer.Option("--dataset", help="gsm8k, math500, aime24, amc23, olympiadbench, a JSONL "
                                         "path or a hub data set id.")] = "gsm8k",
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N problems only.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default bench_out/<dataset>); one bench "
                                          "writes it at a time (a second one is refused).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip cells already in <out>/records.jsonl.")] = False,
    match_budget: Annotated[bool, typer.Option("--match-budget", help=f"Baselines get {matched_target()}'s measured "
                                               "mean active KV as budget (the paper's fair comparison).")] = False,
    fidelity: Annotated[bool, typer.Option("--fidelity/--no-fidelity", help="Teacher-forced fidelity to full KV.")] = True,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain line per finished cell.")] = False,
    n_parallel: Annotated[int, typer.Option("-np", "--parallel", help="Decode N sequences (cells of one or several "
                                            "problems, fidelity passes included) together in one batched forward; "
                                            "a finished one leaves and the next joins. Records equal -np 1's under greedy "
                                            "--dtype fp32 (elsewhere up to float rounding). Each "
                                            "sequence has its own cache: N is bounded by free memory, not -c.")] = 1,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="auto|ADDRESS", help="Run the cells on Ray workers "
                                               "(pip install 'zoomr\\[ray]'): auto starts Ray on this machine, "
                                               "HOST:PORT joins a cluster (ray start --head). This process stays "
                                               "the only writer; --resume works as without.")] = None,
    ray_workers: Annotated[Optional[int], typer.Option("--ray-workers", help="Ray workers, each loading the "
                                                       "model once (default: one per GPU, else one per -t CPUs; "
                                                       "-t defaults to 1 per worker).")] = None,
    show_datasets: Annotated[bool, typer.Option("--list-datasets", help="List the data set names found here "
                                                "(problems, source, fields) and exit.")] = False,
    *,
    opts: RunOptions,
    rescue: RescueOptions,
) -> int:
    """Compare KV policies: accuracy, fidelity to full KV, active KV memory, decode speed, no answer at the cap.

    With --rescue, every budget also runs KV-Rescue (base evicting by --base-policy + full-KV helper) and
    the eviction-only best-of-N baseline: recovered fraction, helper share and base tokens are reported.
    """
    if show_datasets:
        _print_datasets(no_live)
        return 0
    items = [p.strip() for p in policies.split(",")]
    chosen = [p for p in items if p]
    if chosen and len(chosen) != len(items):   # none at all is the engine's refusal
        raise UserError(f"--policies {policies!r}: an empty name between commas")
    ui = Output(live=not no_live)
    view = _View(ui, opts, no_live)
    try:
        run_bench(opts, chosen, budget, dataset=dataset, limit=limit, out=out_dir, resume=resume,
                  match_budget=match_budget, fidelity=fidelity, n_parallel=n_parallel,
                  rescue=rescue if rescue.rescue else None, on_event=view, ray=ray, ray_workers=ray_workers)
    except KeyboardInterrupt:
        if view.out is not None:   # cells ran and the summary of what finished is written
            ui.info(f"interrupted: finished cells are kept in {view.out}; the same command with --resume runs the rest")
        raise
    finally:
        view.stop()
    return 0


class _View:
    """Draws a bench's events (:mod:`zoomr.evaluation.bench_events`) on the terminal: stderr lines, the progress
    bar and live table (a terminal without ``--no-live``), one plain line per record on stdout (``--no-live``),
    and the final tables (or JSON rows)."""

    def __init__(self, ui: Output, opts: RunOptions, no_live: bool):
        self.ui, self.opts, self.no_live = ui, opts, no_live
        self.status = self.live = self.out = None
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn())
        self.task = self.progress.add_task("bench", total=0)
        self.draw = {ev.Info: lambda e: ui.info(e.text), ev.Warning: lambda e: ui.info(f"warning: {e.text}"),
                     ev.Loading: self._loading,
                     ev.BenchStarted: self._started, ev.CellFinished: self._recorded,
                     ev.BatchStarted: lambda e: self._describe(f"{e.cells} cells · -np {e.n_parallel}"),
                     ev.CellStarted: lambda e: self._describe(f"{e.problem_id} · {e.policy} B={e.budget}"),
                     ev.SummaryWritten: self._summary, ev.BenchFinished: self._finished}

    def __call__(self, event) -> None:
        self.draw[type(event)](event)

    def _loading(self, e: ev.Loading) -> None:
        if e.ended:
            self.status.__exit__(None, None, None)
            return
        helper = e.what == "helper"
        self.status = self.ui.status("loading helper and scorer…") if helper else loading(self.ui, self.opts)
        self.status.__enter__()

    def _started(self, e: ev.BenchStarted) -> None:
        problems = count(e.problems, "problem")
        if e.model is not None:
            rescue = f" + KV-Rescue (base {e.rescue_base})" if e.rescue_base else ""
            runs = "policies " + ", ".join(e.policies) + rescue
            self.ui.info(f"{e.model} · {runs} · {e.dataset}: {problems} · {e.out}")
        else:  # a finished bench: the table and files come from the records alone, no model is loaded
            self.ui.info(f"{e.dataset}: every cell of {problems} is already in {e.out}")
        self.progress.update(self.task, total=e.total, completed=e.done)
        if not self.no_live and self.ui.err.is_terminal:
            self.live = Live(Group(self.progress, main_table(summarize(e.records))), refresh_per_second=2,
                             transient=False, console=self.ui.err)
            self.live.start()

    def _describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def _recorded(self, e: ev.CellFinished) -> None:
        if self.no_live:
            print(_plain(e.record), flush=True)
        self.progress.advance(self.task)
        if self.live:
            self.live.update(Group(self.progress, main_table(summarize(e.records))))

    def stop(self) -> None:
        if self.live:
            self.live.stop()
            self.live = None

    def _summary(self, e: ev.SummaryWritten) -> None:
        self.stop()
        rows, rescue = e.summary["rows"], e.summary.get("rescue", [])
        if not self.ui.live:
            for r in rows + rescue:
                print(json.dumps(r))
            return
        self.ui.out.print(main_table(rows))
        if any(r["budget"] == MATCHED for r in rows):
            self.ui.out.print(match_table(rows))
        self.ui.out.print(memory_table(rows))
        if rescue:
            self.ui.out.print(rescue_table(rescue))

    def _finished(self, e: ev.BenchFinished) -> None:
        self.stop()
        self.out = e.out
        if e.summary is None:
            self.ui.info(f"no cell finished: nothing recorded in {e.out}")
        else:
            self.ui.info(f"records: {e.out / 'records.jsonl'} · summary: {e.summary} · plots: "
                         + ", ".join(str(p) for p in e.plots))


DATASET_COLUMNS = (("name", "name", ""), ("problems", "problems", ""), ("question", "question", ""),
                   ("gold", "gold", ""), ("source", "source", ""))


def _print_datasets(plain: bool) -> None:
    """``--list-datasets``: a table on stdout, or one JSON object per set with ``--no-live``."""
    rows = list_datasets()
    if plain:
        for r in rows:
            print(json.dumps(r))
        return
    Output(live=True).out.print(grid("data sets · source: shipped with zoomr, or the $ZOOMR_DATA file that "
                                      "overrides it", DATASET_COLUMNS, rows))


def _plain(rec: dict) -> str:
    fid = "" if rec.get("fidelity_top1") is None else f" top1={rec['fidelity_top1']:.3f} kl={rec['fidelity_kl']:.3f}"
    if "helper_share" in rec:
        fid += f" steps={rec['steps']} helper={rec['helper_share']:.2f} base_tokens={rec['base_tokens']}"
    budget = "-" if rec["budget"] is None else rec["budget"]  # full, sumr, zoomr size themselves
    return (f"{rec['problem_id']} {rec['policy']} B={budget} correct={rec['correct']} "
            f"tokens={rec['tokens_generated']} activeKV={rec['mean_active_tokens']:.0f}{_match_note(rec)}{fid}")


def _match_note(rec: dict) -> str:
    if rec.get("match_error") is None:
        return ""
    flag = "" if rec["matched_within"] else " OFF-TARGET"
    return f" chosen_B={rec['budget_tokens']} target={rec['target_active_tokens']:.0f} err={rec['match_error']:+.1%}{flag}"


bench_command = model_options(exclude=("budget", "policy"), n_predict=BENCH_N_PREDICT,
                              shown={"temp": "0, greedy; 0.8 in --rescue cells"},
                              helps={"backend": "torch only: bench compares the policies on one decoder (how llama.cpp "
                                                "runs them: docs/backends.md)."})(rescue_options(bench))
