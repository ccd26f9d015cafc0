"""Wall time of ``zoomr bench -np N`` against ``-np 1`` on the same cells, and whether their records agree.

Runs the same bench twice in one invocation (each a fresh ``zoomr bench`` process, model load included):
``--limit`` GSM8K problems, ``-n`` tokens, ``--policies``, once with ``-np 1`` and once with ``-np N``, then
compares the records field by field (timings aside; KL to 1e-4 relative, see
``zoomr.evaluation.records.record_differences``). The issue's target: 8 problems, ``-n 128``, full + rkv,
``-np 8`` at least 3× faster than ``-np 1``. On a shared machine the absolute times move with the load
(the 1-minute load average before and after is recorded).

    python benchmarks/bench_parallel.py [--limit 8] [-n 128] [-np 8] [--policies full,rkv] [--budget 64]
        [-t 2] [--device cpu] [--dtype fp32] [--json out.json|-]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import engine_parser, write_json  # benchmarks/ is on sys.path when a script runs


def run_bench(args, n_parallel: int, out: Path) -> float:
    """Seconds one ``zoomr bench`` process takes (model load included)."""
    cmd = [sys.executable, "-m", "zoomr", "bench", "--dataset", "gsm8k", "--limit", str(args.limit),
           "-n", str(args.n_predict), "--policies", args.policies, "--budget", str(args.budget),
           "--device", args.device, "--dtype", args.dtype, "--quant", args.quant, "-t", str(args.threads), "--no-live",
           "-np", str(n_parallel), "--out", str(out)] + (["-m", args.model] if args.model else [])
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"bench_parallel: zoomr bench -np {n_parallel} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    return seconds


def main() -> None:
    ap = engine_parser(__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=8, help="GSM8K problems")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("--policies", default="full,rkv")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the record here (- for stdout)")
    args = ap.parse_args()
    from zoomr.evaluation.records import record_differences

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        outs = {n: Path(tmp) / f"np{n}" for n in (1, args.parallel)}
        wall = {n: run_bench(args, n, out) for n, out in outs.items()}
        recs = {n: [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
                for n, out in outs.items()}
    diffs = record_differences(recs[1], recs[args.parallel])
    record = {"limit": args.limit, "n_predict": args.n_predict, "policies": args.policies, "budget": args.budget,
              "device": args.device, "dtype": args.dtype, "quant": args.quant, "threads": args.threads, "parallel": args.parallel,
              "cells": len(recs[1]), "wall_s_np1": round(wall[1], 2), f"wall_s_np{args.parallel}": round(wall[args.parallel], 2),
              "ratio": round(wall[1] / wall[args.parallel], 2), "records_equal": not diffs, "differences": diffs[:10],
              "generated_tokens": sum(r["tokens_generated"] for r in recs[1]),
              "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(f"-np 1: {wall[1]:.1f} s · -np {args.parallel}: {wall[args.parallel]:.1f} s · ratio "
          f"{record['ratio']:.2f}× · records {'equal' if not diffs else 'DIFFER'} · {record['cells']} cells, "
          f"load {record['load_avg_1min']}", file=sys.stderr)
    write_json(record, args.json)


if __name__ == "__main__":
    main()
