"""``zoomr bench``: accuracy, fidelity to full KV, memory and speed of KV policies on a math data set.

Each (problem, policy, budget) cell is appended to ``records.jsonl`` the moment it finishes; ``--resume``
skips every cell already there, so a crash or ``kill -9`` loses at most the cell in flight.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich import box
from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .bench_log import RecordLog, record_key
from .bench_metrics import summarize
from .bench_plots import write_plots
from .bench_rescue import BEST_OF_N, RESCUE, RescueCells, rescue_rows
from .bench_rescue import plan as plan_rescue_cells
from .bench_run import run_cell
from .datasets import list_datasets, load_problems
from .errors import UserError
from .factory import build_backend, check_lengths, with_policy
from .options import POLICIES, RunOptions, model_options
from .render import Output
from .rescue_options import RescueOptions, rescue_options
from .solve import solve_prompt

BUDGETED = ("streaming", "h2o", "snapkv", "rkv")


def plan_cells(policies: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    """(policy, budget) cells per problem, full first (the fidelity reference); unbudgeted policies once."""
    cells = [("full", None)]
    cells += [(p, None) for p in policies if p not in BUDGETED and p != "full"]
    cells += [(p, b) for b in budgets for p in policies if p in BUDGETED]
    return cells


def _grid(title: str, cols: tuple, rows: list[dict]) -> Table:
    """A compact table (fits 80 columns): ``cols`` are (header, row key, format spec; "" = str)."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 1), collapse_padding=True)
    for i, (head, _, _) in enumerate(cols):
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*("—" if r[key] is None else format(r[key], fmt) if fmt else str(r[key]) for _, key, fmt in cols))
    return t


MAIN_COLUMNS = (("policy", "policy", ""), ("B", "budget", ""), ("n", "problems", ""), ("acc", "accuracy", ".2f"),
                ("top1", "fidelity_top1", ".3f"), ("KL", "fidelity_kl", ".3f"),
                ("KV", "kv_mean_active_tokens", ".0f"), ("peak", "kv_peak_active_tokens", ""),
                ("×", "saving", ".2f"), ("tok/s", "decode_tok_s", ".1f"), ("gen", "mean_generated_tokens", ".0f"),
                ("degen", "degeneration_rate", ".2f"))
RESCUE_COLUMNS = (("B", "budget", ""), ("A full", "acc_full", ".2f"), ("A bon", "acc_best_of_n", ".2f"),
                  ("A rescue", "acc_rescue", ".2f"), ("recov", "recovered_fraction", ".0%"),
                  ("helper", "helper_share", ".0%"), ("base tok", "base_tokens_rescue", ".0f"),
                  ("bon tok", "base_tokens_best_of_n", ".0f"), ("ratio", "base_token_ratio", ".2f"),
                  ("degen", "degeneration_rescue", ".2f"), ("bon degen", "degeneration_best_of_n", ".2f"))


def _table(rows: list[dict]) -> Table:
    return _grid("zoomr bench · KV = mean active KV tokens · × = memory saving · gen = generated tokens",
                 MAIN_COLUMNS, rows)


def _rescue_table(rows: list[dict]) -> Table:
    return _grid("KV-Rescue vs eviction-only best-of-N (bon) · recov = recovered fraction · tok = base tokens",
                 RESCUE_COLUMNS, rows)


def bench(
    budget: Annotated[Optional[list[int]], typer.Option("--budget", help="KV budget B (tokens); repeat for several (default 64).")] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policies to compare.")] = ",".join(POLICIES),
    dataset: Annotated[str, typer.Option("--dataset", help="gsm8k, math500, aime24, amc23, olympiadbench, a JSONL "
                                         "path or a hub data set id.")] = "gsm8k",
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N problems only.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default bench_out/<dataset>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip cells already in <out>/records.jsonl.")] = False,
    match_budget: Annotated[bool, typer.Option("--match-budget", help="Baselines get zoomr's measured mean active "
                                               "KV as budget (the paper's fair comparison).")] = False,
    fidelity: Annotated[bool, typer.Option("--fidelity/--no-fidelity", help="Teacher-forced fidelity to full KV.")] = True,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain line per finished cell.")] = False,
    show_datasets: Annotated[bool, typer.Option("--list-datasets", help="List the data set names found here "
                                                "(problems, source, fields) and exit.")] = False,
    *,
    opts: RunOptions,
    rescue: RescueOptions,
) -> int:
    """Compare KV policies: accuracy, fidelity to full KV, active KV memory, decode speed, degeneration.

    With --rescue, every budget also runs KV-Rescue (base evicting by --base-policy + full-KV helper) and
    the eviction-only best-of-N baseline: recovered fraction, helper share and base tokens are reported.
    """
    if show_datasets:
        _print_datasets(no_live)
        return 0
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in chosen if p not in POLICIES]
    if not chosen:
        raise UserError(f"--policies: give at least one of {', '.join(POLICIES)}")
    if bad:
        raise UserError(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(POLICIES)})")
    if opts.backend != "torch":
        raise UserError("zoomr bench compares policies on the torch backend (--backend torch)")
    check_lengths(opts)
    budgets = sorted(set(budget or [64]))
    if min(budgets) < 1:
        raise UserError(f"--budget must be >= 1 token, got {min(budgets)}")
    if match_budget and "zoomr" not in chosen:
        raise UserError("--match-budget needs zoomr among --policies (its measured KV sets the budget)")
    sampling = opts.sampling(default_temp=0.0)
    name, problems = load_problems(dataset, limit)
    out = Path(out_dir or f"bench_out/{Path(name).name.replace('/', '_')}")
    config = {"dataset": name, "model": opts.model or "default", "backend": opts.backend, "dtype": opts.dtype,
              "n_predict": opts.n_predict, "ctx_size": opts.ctx_size, "sampling": vars(sampling),
              "match_budget": match_budget, "fidelity": fidelity,
              "policy_knobs": {"window": opts.window, "sink": opts.sink, "topk_per_head": opts.topk_per_head,
                               "consensus": opts.consensus, "summaries": opts.summaries}}
    rescue_plan = None
    if rescue.rescue:
        rescue_plan, config["rescue"] = plan_rescue_cells(rescue, opts)
    log = _open_log(out, config, resume)
    ui = Output(live=not no_live)
    cells = plan_cells(chosen, [] if match_budget else budgets)
    if match_budget:
        cells = [c for c in cells if c[0] in ("full", "zoomr", "sumr")] + [(p, "matched") for p in chosen if p in BUDGETED]
    if rescue_plan is not None:
        cells += RescueCells.cells(["matched"] if match_budget else budgets)
    base = rescue_cells = None
    if any(record_key(p.id, c, b) not in log.done for p in problems for c, b in cells):
        with ui.status("loading model…"):
            base = build_backend(replace(opts, policy="full"))
        if rescue_plan is not None:
            with ui.status("loading helper and scorer…"):
                rescue_cells = RescueCells(base, opts, rescue_plan)
        # only now, with every model loaded, does the folder take this run's settings
        (out / "config.json").write_text(json.dumps(config, indent=2))
        ui.info(f"{base.describe()} · {name}: {len(problems)} problems · {out}")
    else:  # a finished bench: the table and files come from the records alone, no model is loaded
        ui.info(f"{name}: every cell of {len(problems)} problems is already in {out}")
    total = len(problems) * len(cells)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("bench", total=total)
    live = Live(Group(progress, _table(summarize(log.records))), refresh_per_second=2, transient=False,
                console=ui.err) if not no_live else None
    try:
        if live:
            live.start()
        for problem in problems:
            pending = [(p, b) for p, b in cells if record_key(problem.id, p, b) not in log.done]
            if not pending:
                progress.advance(task, len(cells))
                continue
            progress.advance(task, len(cells) - len(pending))
            ids = solve_prompt(base.tokenizer, problem.question)
            reference = None
            if fidelity and any(p not in ("full", RESCUE, BEST_OF_N) for p, _ in pending):
                # the full-KV run is the yardstick of every other cell: rerun it if it is already recorded
                pending = [("full", None)] + [c for c in pending if c[0] != "full"]
            for policy, b in pending:
                budget_tokens = _matched_budget(log, problem.id) if b == "matched" else b
                progress.update(task, description=f"{problem.id} · {policy}" + ("" if b is None else f" B={b}"))
                if policy in (RESCUE, BEST_OF_N):
                    rec = rescue_cells.run(policy, budget_tokens or opts.budget, problem, ids, opts.n_predict)
                    built = None
                else:
                    view = with_policy(base, replace(opts, policy=policy, budget=budget_tokens or opts.budget))
                    rec, built = run_cell(view, problem, ids, sampling, opts.n_predict,
                                          None if policy == "full" or not fidelity else reference,
                                          keep_logits=policy == "full" and fidelity)
                if policy == "full":
                    reference = built
                if record_key(problem.id, policy, b) in log.done:
                    continue  # a reference rerun, recorded before
                log.append({"problem_id": problem.id, "policy": policy, "budget": b, "budget_tokens": budget_tokens,
                            "gold": problem.gold, **rec})
                if no_live:
                    print(_plain(log.records[-1]), flush=True)
                progress.advance(task)
                if live:
                    live.update(Group(progress, _table(summarize(log.records))))
    finally:
        if live:
            live.stop()
        _finish(out, config, log, ui)
    return 0


DATASET_COLUMNS = (("name", "name", ""), ("problems", "problems", ""), ("question", "question", ""),
                   ("gold", "gold", ""), ("source", "source", ""))


def _print_datasets(plain: bool) -> None:
    """``--list-datasets``: a table on stdout, or one JSON object per set with ``--no-live``."""
    rows = list_datasets()
    if plain:
        for r in rows:
            print(json.dumps(r))
        return
    Output(live=True).out.print(_grid("data sets · source: shipped with zoomr, or the $ZOOMR_DATA file that "
                                      "overrides it", DATASET_COLUMNS, rows))


def _matched_budget(log: RecordLog, problem_id: str) -> int:
    """zoomr's measured mean active KV on this problem (tokens), the budget the baselines get."""
    for r in log.records:
        if r["problem_id"] == problem_id and r["policy"] == "zoomr":
            return max(1, round(r["kv_mean_active_tokens"]))
    raise UserError("internal order error: zoomr must run before the matched baselines")


def _open_log(out: Path, config: dict, resume: bool) -> RecordLog:
    """Create ``out`` and check it against this run (settings of a resumed run must not change).

    Raises:
        UserError: the folder cannot be made, holds records without --resume, or other settings.
        ValueError: a records file that is not ours.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    cfg_path, rec_path = out / "config.json", out / "records.jsonl"
    if rec_path.exists() and rec_path.stat().st_size and not resume:
        raise UserError(f"{out} already holds bench records: add --resume, or choose another --out")
    if resume and cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{cfg_path}: not a bench config (not JSON); remove it or choose another --out") from None
        # a setting the old run did not have (e.g. --rescue added later) only adds cells: allowed
        diff = [k for k in config if k in old and old[k] != config[k]]
        if diff:
            raise UserError(f"--resume: settings differ from the run in {out} ({', '.join(diff)})")
        config.update({k: v for k, v in old.items() if k not in config})
    return RecordLog(rec_path)


def _plain(rec: dict) -> str:
    fid = "" if rec.get("fidelity_top1") is None else f" top1={rec['fidelity_top1']:.3f} kl={rec['fidelity_kl']:.3f}"
    if "helper_share" in rec:
        fid += f" steps={rec['steps']} helper={rec['helper_share']:.2f} base_tokens={rec['base_tokens']}"
    return (f"{rec['problem_id']} {rec['policy']} B={rec['budget']} correct={rec['correct']} "
            f"tokens={rec['tokens_generated']} activeKV={rec['kv_mean_active_tokens']:.0f}{fid}")


def _finish(out: Path, config: dict, log: RecordLog, ui: Output) -> None:
    """summary.json, plots and the final table from whatever records exist (also after Ctrl-C)."""
    if not log.records:
        ui.info(f"no cell finished: nothing recorded in {out}")
        return
    rows = summarize(log.records)
    rescue = rescue_rows(rows)
    summary = {"config": config, "rows": rows, **({"rescue": rescue} if rescue else {})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = write_plots(rows, log.records, out) if log.records else []
    if ui.live:
        ui.out.print(_table(rows))
        if rescue:
            ui.out.print(_rescue_table(rescue))
    else:
        for r in rows + rescue:
            print(json.dumps(r))
    ui.info(f"records: {out / 'records.jsonl'} · summary: {out / 'summary.json'} · plots: "
            + ", ".join(str(p) for p in plots))


bench_command = model_options(exclude=("budget", "policy"), n_predict=256, top_k=20)(rescue_options(bench))
