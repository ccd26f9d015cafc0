"""What the benchmark scripts share: the model/engine flags, and ``--json PATH`` (``-``: stdout) for the record."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_json(record: dict, dest: str | None) -> None:
    """Write ``record`` as indented JSON to ``dest`` (a path, ``-`` for stdout, None for nowhere)."""
    if not dest:
        return
    text = json.dumps(record, indent=1)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def engine_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every torch-vs-llama.cpp benchmark takes: -m, -t (default 2), --device, --dtype,
    --quant (the torch backend's ``--quant``). --dtype and --quant default to ``auto``, as zoomr's CLI does, so a
    benchmark run without them measures what a user gets; ``--dtype fp32 --quant none`` is the dense fp32
    reference (greedy records equal to the last bit, the batched oneDNN path)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="torch dtype: auto (the CLI's default), fp32, bf16")
    ap.add_argument("--quant", default="auto",
                    help="torch weights: auto (the CLI's default), none, ggml, int4, int8, fp16, w8a8")
    return ap


def zoomr_bench(args, extra: list[str], out: Path, label: str) -> float:
    """Seconds one ``zoomr bench`` process takes (model load included) on ``args``' cells (``--limit``, ``-n``,
    ``--policies``, ``--budget`` where one of the policies reads it, and the engine flags) plus ``extra`` flags,
    writing to ``out``.

    Exits (naming ``label``) when the bench fails."""
    cmd = [sys.executable, "-m", "zoomr", "bench", "--dataset", "gsm8k", "--limit", str(args.limit),
           "-n", str(args.n_predict), "--policies", args.policies, *budget_flag(args),
           "--device", args.device, "--dtype", args.dtype, "--quant", args.quant, "--no-live",
           "--out", str(out)] + (["-m", args.model] if args.model else []) + extra
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"zoomr bench {label} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return seconds


def bench_records(out: Path) -> list[dict]:
    """The records a bench wrote to ``out``."""
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def bench_pair_parser(description: str, *, n_predict: int, parallel: int, budget: int) -> argparse.ArgumentParser:
    """:func:`engine_parser` plus the flags of a script that runs one bench two ways on the same cells:
    --limit (GSM8K problems), -n, -np, --policies, --budget and --json."""
    ap = engine_parser(description)
    ap.add_argument("--limit", type=int, default=8, help="GSM8K problems")
    ap.add_argument("-n", "--n-predict", type=int, default=n_predict)
    ap.add_argument("-np", "--parallel", type=int, default=parallel)
    ap.add_argument("--policies", default="full,rkv")
    ap.add_argument("--budget", type=int, default=budget)
    ap.add_argument("--json", default=None, help="write the record here (- for stdout)")
    return ap


def budget_flag(args) -> list[str]:
    """``--budget B`` when one of ``args.policies`` reads a budget (bench refuses it otherwise), else nothing."""
    from zoomr.kvstore.registry import knob_flags

    readers = knob_flags()["budget"].readers
    return ["--budget", str(args.budget)] if any(p in readers for p in args.policies.split(",")) else []


def run_bench_pair(args, runs: dict[str, list[str]]) -> tuple[dict[str, float], dict[str, list[dict]], float, dict]:
    """Run one ``zoomr bench`` process per entry of ``runs`` ({label: its extra flags}) on ``args``' cells, one
    after another, each into a temporary folder.

    Returns:
        ({label: wall seconds}, {label: its records}, the 1-minute load average before the first,
        {label: its model line}: what ``--dtype``/``--quant auto`` resolved to, from its ``config.json``).
    """
    load_before = os.getloadavg()[0]
    walls, records, lines = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, extra) in enumerate(runs.items()):
            out = Path(tmp) / f"run{i}"
            walls[label] = zoomr_bench(args, extra, out, label)
            records[label] = bench_records(out)
            lines[label] = json.loads((out / "config.json").read_text())["provenance"].get("model_line")
    return walls, records, load_before, lines


def report_pair(args, first: list[dict], second: list[dict], load_before: float, fields: dict, line: str,
                model_lines: dict) -> dict:
    """Report a two-way bench script's run: the record (both runs' shared settings, their model lines, whether
    their records agree by ``zoomr.evaluation.records.record_differences`` with the first 10 differences, the
    machine's load, plus the script's ``fields``) to ``--json``, and on stderr the first run's model line, then
    ``line`` with the agreement and cell count."""
    from zoomr.evaluation.records import record_differences

    diffs = record_differences(first, second)
    record = {"limit": args.limit, "n_predict": args.n_predict, "policies": args.policies, "budget": args.budget,
              "device": args.device, "dtype": args.dtype, "quant": args.quant, "model_lines": model_lines,
              "parallel": args.parallel,
              "cells": len(first), "records_equal": not diffs, "differences": diffs[:10],
              "generated_tokens": sum(r["tokens_generated"] for r in first),
              "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], **fields}
    print(next(iter(model_lines.values())), file=sys.stderr)
    print(f"{line} · records {'equal' if not diffs else 'DIFFER'} · {len(first)} cells, load "
          f"{record['load_avg_1min']}", file=sys.stderr)
    write_json(record, args.json)
    return record
