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

from zoomr.kvstore.registry import REFERENCE, budgeted, knob_flags, policy_names

from zoomr.evaluation.records import RecordLog, read_config, record_key, write_config
from zoomr.evaluation.match import TOLERANCE, match_error, match_fields, predict_budget
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.plots import write_plots
from zoomr.evaluation.provenance import run_provenance
from zoomr.evaluation.rescue_cells import BEST_OF_N, RESCUE, RescueCells, rescue_rows, rescue_warnings
from zoomr.evaluation.rescue_cells import plan as plan_rescue_cells
from zoomr.evaluation.bench_plan import MATCHED, plan_cells, validate_cells
from zoomr.evaluation.batching import CellRun, FidelityJob, GenerationJob, check_parallel, run_cell, run_cells
from zoomr.evaluation.batching import teacher_forced_fidelity
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import list_datasets, load_problems
from zoomr.errors import UserError
from zoomr.factory import build_backend, check_knob_sizes, check_lengths, policy_spec, with_policy
from zoomr.options import RunOptions, knob_scope, not_read
from zoomr.cli.options import loading, model_options
from zoomr.cli.inputs import unwritable
from zoomr.cli.render import Output, count
from zoomr.rescue.plan import RescueOptions
from zoomr.cli.rescue_options import rescue_options

def _cell(r: dict, key, fmt: str) -> str:
    value = key(r) if callable(key) else r.get(key)
    if value is None:
        return "—"
    if fmt == "mib":
        return f"{value / 2**20:.2f}"
    if fmt == "kib":
        return f"{value / 2**10:.1f}"
    if key == "bound_tokens" and r.get("bound_measured"):
        return f"{value}*"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, fmt) if fmt else str(value)


def _grid(title: str, cols: tuple, rows: list[dict]) -> Table:
    """A compact table: ``cols`` are (header, row key or function of the row, format spec; "" = str)."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 1), collapse_padding=True)
    for i, (head, _, _) in enumerate(cols):
        t.add_column(head, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*(_cell(r, key, fmt) for _, key, fmt in cols))
    return t


def _budget_cell(r: dict) -> str:
    """The B column: the budget, or for matched rows the mean budget chosen, with ≈."""
    if r["budget"] == MATCHED:
        return "—" if r.get("budget_tokens_mean") is None else f"≈{r['budget_tokens_mean']:.0f}"
    return "—" if r["budget"] is None else str(r["budget"])


MAIN_COLUMNS = (("policy", "policy", ""), ("B", _budget_cell, ""), ("n", "problems", ""), ("acc", "accuracy", ".2f"),
                ("top1", "fidelity_top1", ".3f"), ("KL", "fidelity_kl", ".3f"),
                ("KV", "mean_active_tokens", ".0f"), ("peak", "peak_active_tokens", ""),
                ("bound", "bound_tokens", ""), ("×", "saving", ".2f"), ("×pk", "saving_peak", ".2f"),
                ("no ans", "no_answer_at_cap_rate", ".2f"))
MATCH_COLUMNS = (("policy", "policy", ""), ("n", "problems", ""), ("target KV", "target_active_tokens", ".1f"),
                 ("achieved", "mean_active_tokens", ".1f"), ("target peak", "target_peak_active_tokens", ""),
                 ("peak", "peak_active_tokens", ""), ("B chosen", "budget_tokens_mean", ".0f"),
                 ("worst err", "match_error_max", "+.1%"), ("within ±10%", "matched_within", ""))
MEMORY_COLUMNS = (("policy", "policy", ""), ("B", _budget_cell, ""), ("active MiB", "mean_active_bytes", "mib"),
                  ("full MiB", "full_bytes", "mib"), ("state KiB", "policy_state_bytes", "kib"),
                  ("device MiB", "device_kv_bytes", "mib"),
                  ("host MiB", "host_kv_bytes", "mib"), ("on", "kv_device", ""), ("tok/s", "decode_tok_s", ".1f"),
                  ("gen", "mean_generated_tokens", ".0f"))
RESCUE_COLUMNS = (("B", "budget", ""), ("A full", "acc_full", ".2f"), ("A bon", "acc_best_of_n", ".2f"),
                  ("A rescue", "acc_rescue", ".2f"), ("recov", "recovered_fraction", ".0%"),
                  ("helper", "helper_share", ".0%"), ("base tok", "base_tokens_rescue", ".0f"),
                  ("bon tok", "base_tokens_best_of_n", ".0f"), ("ratio", "base_token_ratio", ".2f"),
                  ("no ans", "no_answer_at_cap_rescue", ".2f"), ("bon no ans", "no_answer_at_cap_best_of_n", ".2f"))


def _table(rows: list[dict]) -> Table:
    return _grid("zoomr bench · KV: mean active tokens · bound: policy's (* measured) · ×: saving, mean full / mean "
                 "(active + policy state) bytes · ×pk: at the peak · no ans: no answer at the -n cap",
                 MAIN_COLUMNS, rows)


def _match_table(rows: list[dict]) -> Table:
    return _grid(f"matched budgets · each baseline's measured mean active KV vs ZoomR's (within ±{TOLERANCE:.0%} "
                 "or flagged) · peaks: most positions in one forward (ZoomR's set grows, a budget's does not)",
                 MATCH_COLUMNS, [r for r in rows if r["budget"] == MATCHED])


def _memory_table(rows: list[dict]) -> Table:
    return _grid("KV memory and speed · active: time-averaged, full: final K/V bytes · state: the policy's own "
                 "tensors on the device (scores, mean keys, queries), at the peak · device/host: peak allocated, "
                 "state included (on cpu the same RAM: they add up) · gen: generated tokens", MEMORY_COLUMNS, rows)


def _rescue_table(rows: list[dict]) -> Table:
    return _grid("KV-Rescue vs eviction-only best-of-N (bon) · recov = recovered fraction · tok = base tokens",
                 RESCUE_COLUMNS, rows)


def bench(
    budget: Annotated[Optional[list[int]], typer.Option("--budget", help="KV budget B (tokens); repeat for several (default 64).")] = None,
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policies to compare.")] = ",".join(policy_names()),
    dataset: Annotated[str, typer.Option("--dataset", help="gsm8k, math500, aime24, amc23, olympiadbench, a JSONL "
                                         "path or a hub data set id.")] = "gsm8k",
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N problems only.")] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output folder (default bench_out/<dataset>).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Skip cells already in <out>/records.jsonl.")] = False,
    match_budget: Annotated[bool, typer.Option("--match-budget", help="Baselines get zoomr's measured mean active "
                                               "KV as budget (the paper's fair comparison).")] = False,
    fidelity: Annotated[bool, typer.Option("--fidelity/--no-fidelity", help="Teacher-forced fidelity to full KV.")] = True,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain line per finished cell.")] = False,
    n_parallel: Annotated[int, typer.Option("-np", "--parallel", help="Decode N sequences (cells of one or several "
                                            "problems, fidelity passes included) together in one batched forward; "
                                            "a finished one leaves and the next joins. Records equal -np 1's under greedy "
                                            "--dtype fp32 (elsewhere up to float rounding). Each "
                                            "sequence has its own cache: N is bounded by free memory, not -c.")] = 1,
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
    names = policy_names()
    items = [p.strip() for p in policies.split(",")]
    chosen = [p for p in items if p]
    bad = [p for p in chosen if p not in names]
    if not chosen:
        raise UserError(f"--policies: give at least one of {', '.join(names)}")
    if len(chosen) != len(items):
        raise UserError(f"--policies {policies!r}: an empty name between commas")
    twice = sorted({p for p in chosen if chosen.count(p) > 1})
    if twice:
        raise UserError(f"--policies: {', '.join(twice)} given more than once (each policy runs once per budget)")
    if bad:
        raise UserError(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(names)})")
    if opts.backend != "torch":
        raise UserError("zoomr bench compares policies on the torch backend (--backend torch)")
    if n_parallel < 1:
        raise UserError(f"-np must be >= 1 parallel sequence, got {n_parallel}")
    check_lengths(opts)
    budgets = sorted(set(budget or [knob_flags()["budget"].default]))
    if min(budgets) < 1:
        raise UserError(f"--budget must be at least 1 token, got {min(budgets)}")
    if match_budget and budget:
        raise UserError("--match-budget chooses each baseline's budget from zoomr's measured KV: drop --budget")
    if budget and not rescue.rescue and not set(chosen) & set(budgeted()):
        raise UserError(not_read("--budget", budgeted()))
    if budget:   # a budget typed (the default 64 is no user's choice: a tiny -c with full alone is fine)
        check_knob_sizes(opts.with_knobs(budget=max(budgets)))
    if match_budget and "zoomr" not in chosen:
        raise UserError("--match-budget needs zoomr among --policies (its measured KV sets the budget)")
    sampling = opts.sampling(default_temp=0.0)
    name, problems = load_problems(dataset, limit)
    out = Path(out_dir or f"bench_out/{Path(name).name.replace('/', '_')}")
    config = {"dataset": name, "model": opts.model or "default", "backend": opts.backend, "dtype": opts.dtype,
              "quant": opts.quant, "kv_dtype": opts.kv_dtype, "compile": opts.compile, "n_predict": opts.n_predict,
              "ctx_size": opts.ctx_size,
              "sampling": vars(sampling),
              "ignore_eos": opts.ignore_eos,
              "match_budget": match_budget, "fidelity": fidelity,
              "policy_knobs": {k: opts.knob(k) for k in knob_flags() if k != "budget"}}
    rescue_plan = None
    if rescue.rescue:
        rescue_plan, config["rescue"] = plan_rescue_cells(rescue, opts)
    ui = Output(live=not no_live)
    cells = plan_cells(chosen, budgets, matched=match_budget)
    rescue_base = None
    if rescue_plan is not None:
        cells += RescueCells.cells([MATCHED] if match_budget else budgets)
        rescue_base = rescue_plan.base_opts.policy
    # a knob no policy reads is named as such, before any cell is built
    scope = knob_scope(chosen + ([rescue_base] if rescue_base else []), opts)
    validate_cells(cells, opts, rescue_base)
    for line in scope:
        ui.info(line)
    new_folder = not out.exists()
    log = _open_log(out, config, resume)
    if resume and not log.records:
        # a mistyped --out would otherwise start a long run silently where the user meant to finish one
        ui.info(f"warning: --resume: {out} holds no bench records yet; starting a new run there")
    base = rescue_cells = None
    prompts: dict[str, list[int]] = {}
    try:
        if any(record_key(p.id, c, b) not in log.done for p in problems for c, b in cells):
            base, rescue_cells, prompts = _load_for(opts, rescue_plan, config, problems, cells, log, n_parallel, ui)
    except BaseException:
        if new_folder:  # refused before anything ran (a model that cannot load, -np too large): leave no folder
            _remove_if_empty(out)
        raise
    if base is not None:
        # only now, with every model loaded, does the folder take this run's settings
        write_config(out / "config.json", config)
        # the loaded backend runs full KV (the reference); every cell swaps in its own policy
        runs = "policies " + ", ".join(chosen) + (f" + KV-Rescue (base {rescue_base})" if rescue_base else "")
        ui.info(f"{base.describe_model()} · {runs} · {name}: {count(len(problems), 'problem')} · {out}")
    else:  # a finished bench: the table and files come from the records alone, no model is loaded
        ui.info(f"{name}: every cell of {count(len(problems), 'problem')} is already in {out}")
    total = len(problems) * len(cells)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task("bench", total=total)
    live = Live(Group(progress, _table(summarize(log.records))), refresh_per_second=2, transient=False,
                console=ui.err) if not no_live and ui.err.is_terminal else None
    interrupted = False
    try:
        if live:
            live.start()

        def record(key: tuple, fields: dict, budget_tokens) -> None:
            problem_id, policy, b = key
            if record_key(problem_id, policy, b) in log.done:
                return  # a reference rerun, recorded before
            log.append({"problem_id": problem_id, "policy": policy, "budget": b, "budget_tokens": budget_tokens,
                        "gold": golds[problem_id], **fields})
            if no_live:
                print(_plain(log.records[-1]), flush=True)
            progress.advance(task)
            if live:
                live.update(Group(progress, _table(summarize(log.records))))

        golds = {p.id: p.gold for p in problems}
        later_kinds = any(p in (RESCUE, BEST_OF_N) or b == MATCHED for p, b in cells)
        # matched and rescue cells run one by one after their problem's batched cells (they need its zoomr
        # record and reference), so problems then go through the batch one at a time
        for chunk in ([[p] for p in problems] if later_kinds else [problems]):
            batch, later, references = [], {}, {}
            for problem in chunk:
                pending = [(p, b) for p, b in cells if record_key(problem.id, p, b) not in log.done]
                progress.advance(task, len(cells) - len(pending))
                if pending:
                    batch += _problem_cells(base, opts, problem, prompts[problem.id], sampling, pending, fidelity,
                                            references if later_kinds else None)
                    later[problem.id] = [(p, b) for p, b in pending if p in (RESCUE, BEST_OF_N) or b == MATCHED]
            progress.update(task, description=f"{len(batch)} cells · -np {n_parallel}")
            run_cells(base, batch, n_parallel, lambda c: record(c.key, c.fields(), c.key[2]))
            for problem in chunk:
                ids = prompts.get(problem.id)
                ref_job = references.get(problem.id)
                reference = None if ref_job is None else ref_job.reference
                for policy, b in later.get(problem.id, []):
                    progress.update(task, description=f"{problem.id} · {policy} B={b}")
                    if policy in (RESCUE, BEST_OF_N) and b == MATCHED:
                        rec = rescue_cells.run_matched(policy, problem, ids, opts.n_predict,
                                                       _zoomr_record(log, problem.id))
                        budget_tokens = rec.pop("budget_tokens")
                    elif policy in (RESCUE, BEST_OF_N):
                        budget_tokens = b
                        rec = rescue_cells.run(policy, b, problem, ids, opts.n_predict)
                    else:
                        rec = run_matched(base, opts, policy, problem, ids, sampling, reference,
                                          _zoomr_record(log, problem.id))
                        budget_tokens = rec.pop("budget_tokens")
                    record((problem.id, policy, b), rec, budget_tokens)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if live:
            live.stop()
        _finish(out, config, log, ui)  # also after an error: the summary of whatever finished
        if interrupted:
            ui.info(f"interrupted: finished cells are kept in {out}; the same command with --resume runs the rest")
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


def _problem_cells(base, opts: RunOptions, problem, ids: list[int], sampling, pending: list, fidelity: bool,
                   references: dict) -> list[CellRun]:
    """The batched cells of one problem still to run: full KV first (made again, unrecorded, when it is
    recorded but other cells need it as their fidelity reference), then each plain cell with its fidelity pass.
    Matched and rescue cells are left to the caller; full KV's job goes into ``references[problem.id]``
    (None: no caller needs it after the batch, so its logits are released as soon as fidelity is done)."""
    plain = [(p, b) for p, b in pending if p not in (RESCUE, BEST_OF_N) and b != MATCHED]
    # the full-KV run is the yardstick of every other cell: rerun it if it is already recorded
    want_ref = fidelity and any(p not in (REFERENCE, RESCUE, BEST_OF_N) for p, _ in pending)
    runs = []
    full = None
    if want_ref or (REFERENCE, None) in plain:
        view = with_policy(base, replace(opts, policy=REFERENCE))
        full = GenerationJob(view, problem, ids, sampling, opts.n_predict, keep_logits=want_ref,
                             ignore_eos=opts.ignore_eos, hold_reference=references is not None)
        runs.append(CellRun((problem.id, REFERENCE, None), full))  # recorded only when not yet done
        if references is not None:
            references[problem.id] = full
    for policy, b in plain:
        if policy == REFERENCE:
            continue
        view = with_policy(base, replace(opts, policy=policy).with_knobs(budget=b))
        gen = GenerationJob(view, problem, ids, sampling, opts.n_predict, ignore_eos=opts.ignore_eos)
        runs.append(CellRun((problem.id, policy, b), gen, FidelityJob(view, ids, full) if want_ref else None))
    return runs


def _zoomr_record(log: RecordLog, problem_id: str) -> dict:
    """ZoomR's record of this problem: its measured mean active KV is what the matched baselines aim at."""
    for r in log.records:
        if r["problem_id"] == problem_id and r["policy"] == "zoomr":
            return r
    raise UserError("internal order error: zoomr must run before the matched baselines")


def run_matched(base, opts: RunOptions, policy: str, problem, ids: list[int], sampling, reference, zoomr: dict) -> dict:
    """One matched-budget cell: predict B, run, check the measured mean against ZoomR's (see ``bench_match``).

    Args:
        base: the bench's full-KV torch backend; ``policy``: an evicting baseline.
        reference: full KV's run for fidelity (None: no fidelity), measured on the run kept.
        zoomr: ZoomR's record of the same problem (``mean_active_tokens``, ``tokens_generated``).
    Returns:
        the record fields of the last run (at most two; the second, when it runs, is kept whatever its
        error: choosing the closer would select on output length), plus
        :func:`zoomr.evaluation.match.match_fields`' (``budget_tokens`` = B, ``match_runs``, ``match_kept``).
    """
    target, n = float(zoomr["mean_active_tokens"]), int(zoomr["tokens_generated"])
    spec = policy_spec(replace(opts, policy=policy))
    budget, simulated = predict_budget(spec, target, len(ids), n)
    runs = 0
    while True:
        view = with_policy(base, replace(opts, policy=policy).with_knobs(budget=budget))
        rec = run_cell(view, problem, ids, sampling, opts.n_predict, ignore_eos=opts.ignore_eos)
        runs += 1
        if runs == 2:
            kept = f"second try, B predicted at the first's length ({n} tokens): the last is kept, never the closer"
            break
        if abs(match_error(rec["mean_active_tokens"], target)) <= TOLERANCE:
            kept = f"first try, within ±{TOLERANCE:.0%}"
            break
        if rec["tokens_generated"] == n:
            kept = "first try, zoomr's length: a second try would get the same B"
            break
        # the baseline wrote a different length than ZoomR: predict again at its own length
        n = rec["tokens_generated"]
        again, simulated_again = predict_budget(spec, target, len(ids), n)
        if again == budget:
            kept = f"first try: B predicted at its own length ({n} tokens) is the same"
            break
        budget, simulated = again, simulated_again
    if reference is not None:
        rec.update(teacher_forced_fidelity(view, ids, reference))
    rec.update(match_fields(zoomr, budget, simulated, rec["mean_active_tokens"], runs, kept))
    return rec


def _load_for(opts: RunOptions, rescue_plan, config: dict, problems, cells, log: RecordLog, n_parallel: int,
              ui: Output):
    """The models a bench with cells left to run needs, and the prompts of its problems with cells left.

    Returns:
        (base backend, the rescue cells' models or None, {problem id: prompt ids}).
    Raises:
        UserError / ValueError: a model that cannot load, a prompt over ``-c``, ``-np`` too large for memory.
    """
    rescue_cells = None
    with loading(ui, opts):
        base = build_backend(replace(opts, policy=REFERENCE))
    if rescue_plan is not None:
        with ui.status("loading helper and scorer…"):
            rescue_cells = RescueCells(base, opts, rescue_plan)
    _check_provenance(config, run_provenance(base.source.path))
    # every prompt left to run fits -c (and is valid text), for each model that prefills it
    tokenizers = [base.tokenizer] + ([rescue_cells.helper.tokenizer] if rescue_cells is not None else [])
    prompts = {p.id: [problem_prompt(t, p, opts.ctx_size) for t in tokenizers][0] for p in problems
               if any(record_key(p.id, c, b) not in log.done for c, b in cells)}
    check_parallel(n_parallel, base, max(map(len, prompts.values())), opts.n_predict)
    return base, rescue_cells, prompts


def _remove_if_empty(out: Path) -> None:
    """Remove ``out`` if it holds nothing (a folder this run created and then wrote nothing to)."""
    try:
        out.rmdir()
    except OSError:
        pass


def _open_log(out: Path, config: dict, resume: bool) -> RecordLog:
    """Create ``out`` and check it against this run (settings of a resumed run must not change).

    Raises:
        UserError: the folder cannot be made, holds records without --resume, or other settings.
        ValueError: a records file or config.json that is not ours.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder (bench writes records.jsonl, config.json and "
                        "plots into a folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    why = unwritable(out)
    if why is not None:
        raise UserError(f"--out {out}: cannot write there ({why})")
    cfg_path, rec_path = out / "config.json", out / "records.jsonl"
    if rec_path.exists() and rec_path.stat().st_size and not resume:
        raise UserError(f"{out} already holds bench records: add --resume, or choose another --out")
    if resume and cfg_path.exists():
        old = read_config(cfg_path)
        # a setting the old run did not have (e.g. --rescue added later) only adds cells: allowed
        diff = [k for k in config if k in old and old[k] != config[k]]
        if diff:
            raise UserError(f"--resume: settings differ from the run in {out} ({', '.join(diff)})")
        config.update({k: v for k, v in old.items() if k not in config})
    log = RecordLog(rec_path)
    if log.records and not cfg_path.exists():
        raise UserError(f"--resume: {out} holds records but no config.json, so its settings cannot be checked; "
                        "choose another --out")
    return log


def _check_provenance(config: dict, now: dict) -> None:
    """Put this run's provenance into ``config``; a resumed run must use the same model file.

    Library versions and the git commit may change between a run and its resume (they are recorded, the
    newest wins); a different model under the same name would mix two models' records, so it is refused.

    Raises:
        UserError: the model's sha256 differs from the one the folder's run recorded.
    """
    old = (config.get("provenance") or {}).get("model_sha256")
    if old and now.get("model_sha256") and old != now["model_sha256"]:
        raise UserError(f"--resume: the model file differs from the run's (sha256 {now['model_sha256'][:12]}… "
                        f"vs {old[:12]}…); choose another --out")
    config["provenance"] = now


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


def _finish(out: Path, config: dict, log: RecordLog, ui: Output) -> None:
    """summary.json, plots and the final table from whatever records exist (also after Ctrl-C)."""
    # the file, not the in-memory list, is what finished: a Ctrl-C that lands between a record's fsync and
    # its append to ``log.records`` would otherwise leave a durable record out of the summary
    log = RecordLog(log.path)
    if not log.records:
        ui.info(f"no cell finished: nothing recorded in {out}")
        return
    rows = summarize(log.records)
    rescue = rescue_rows(rows)
    summary = {"config": config, "rows": rows, **({"rescue": rescue} if rescue else {})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    model = (config.get("provenance") or {}).get("model_path") or config["model"]
    meta = {"model": Path(str(model)).name, "dataset": config["dataset"],
            "problems": len({r["problem_id"] for r in log.records}), "n_predict": config["n_predict"]}
    plots = write_plots(rows, log.records, out, meta)
    if ui.live:
        ui.out.print(_table(rows))
        if any(r["budget"] == MATCHED for r in rows):
            ui.out.print(_match_table(rows))
        ui.out.print(_memory_table(rows))
        if rescue:
            ui.out.print(_rescue_table(rescue))
    else:
        for r in rows + rescue:
            print(json.dumps(r))
    for line in rescue_warnings(log.records):
        ui.info(f"warning: {line}")
    idle = [r for r in log.records if r["policy"] == "zoomr" and r.get("saving") and r["saving"] < 1.05]
    if idle and any(r["budget"] == MATCHED for r in rows):
        ui.info(f"warning: zoomr held (almost) full KV on {len(idle)} of its problems (saving < 1.05×): the matched "
                "baselines there compare at full memory; generate longer (-n, --ignore-eos) to compare eviction")
    off = [r["policy"] for r in rows if r.get("matched_within") is False]
    if off:
        ui.info(f"warning: matched budget off by more than {TOLERANCE:.0%} for {', '.join(off)} "
                "(see the matched-budgets table; their memory is not ZoomR's)")
    ui.info(f"records: {out / 'records.jsonl'} · summary: {out / 'summary.json'} · plots: "
            + ", ".join(str(p) for p in plots))


bench_command = model_options(exclude=("budget", "policy"), n_predict=256,
                              shown={"temp": "0, greedy; 0.8 in --rescue cells"},
                              helps={"backend": "torch only: the KV policies run on our decoder (llama.cpp's "
                                                "speed: benchmarks/backend_speed.py)."})(rescue_options(bench))
