"""The end of a bench (also after an error or Ctrl-C): ``summary.json``, plots and the warnings its rows call for,
from whatever records exist."""

from __future__ import annotations

import json
from pathlib import Path

from zoomr.kvstore.registry import REGISTRY, matched_target

from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.atomic import write_atomic
from zoomr.evaluation.match import TOLERANCE
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.plots import write_plots
from zoomr.evaluation.records import MATCHED, RecordLog
from zoomr.evaluation.rescue_cells import rescue_rows, rescue_warnings
from zoomr.evaluation.variants import base_of

IDLE_SAVING = 1.05  # a matched target saving less than this × held (almost) full KV


def finish(out: Path, config: dict, log: RecordLog, emit, warnings: list[str]) -> dict:
    """Write ``out/summary.json`` and the plots from the records in ``log``'s file (each file whole or not at
    all: :mod:`zoomr.evaluation.atomic`), and say what they show. A key the file holds twice counts once
    (:class:`~zoomr.evaluation.records.RecordLog`), with a warning naming it.

    Args:
        config: the run's settings (``config.json``'s); emit: the bench's event callback.
        warnings: the run's warning lines so far; the summary's are appended (and emitted as
            :class:`zoomr.evaluation.bench_events.Warning`).
    Returns:
        the summary ({"config", "rows", and "rescue" when rescue cells ran}; rows [] when no cell finished:
        then nothing is written) plus "out", "records", "plots" (paths) and "warnings".
    """
    # the file, not the in-memory list, is what finished: a Ctrl-C that lands between a record's fsync and
    # its append to ``log.records`` would otherwise leave a durable record out of the summary
    log = RecordLog(log.path)
    for line in log.notes():   # a run that opened the file said these already; a reader here says them once
        if line not in warnings:
            warnings.append(line)
            emit(ev.Warning(line))
    if not log.records:
        emit(ev.BenchFinished(out, None))
        return {"config": config, "rows": [], "out": out, "records": [], "plots": [], "warnings": warnings}
    rows = summarize(log.records)
    rescue = rescue_rows(rows)
    summary = {"config": config, "rows": rows, **({"rescue": rescue} if rescue else {})}
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    model = (config.get("provenance") or {}).get("model_path") or config["model"]
    meta = {"model": Path(str(model)).name, "dataset": config["dataset"],
            "problems": len({r["problem_id"] for r in log.records}), "n_predict": config["n_predict"]}
    plots = write_plots(rows, log.records, out, meta)
    emit(ev.SummaryWritten(summary))
    for line in summary_warnings(log.records, rows):
        warnings.append(line)
        emit(ev.Warning(line))
    emit(ev.BenchFinished(out, out / "summary.json", tuple(plots)))
    return {**summary, "out": out, "records": log.records, "plots": plots, "warnings": warnings}


def summary_warnings(records: list[dict], rows: list[dict]) -> list[str]:
    """What the records of a bench cannot show, one line each: the rescue comparison's limits
    (:func:`zoomr.evaluation.rescue_cells.rescue_warnings`), a matched target that held (almost) full KV, and
    matched rows off their target by more than :data:`zoomr.evaluation.match.TOLERANCE`."""
    lines = list(rescue_warnings(records))
    target = matched_target()
    idle = [r for r in records if base_of(r["policy"]) == target and r.get("saving") and r["saving"] < IDLE_SAVING]
    if idle and any(r["budget"] == MATCHED for r in rows):
        lines.append(f"{target} held (almost) full KV on {len(idle)} of its problems (saving < {IDLE_SAVING}×): "
                     "the matched baselines there compare at full memory; generate longer (-n, --ignore-eos) to "
                     "compare eviction")
    off = [r["policy"] for r in rows if r.get("matched_within") is False]
    if off:
        lines.append(f"matched budget off by more than {TOLERANCE:.0%} for {', '.join(off)} (see the "
                     f"matched-budgets table; their memory is not {REGISTRY[target].display}'s)")
    return lines
