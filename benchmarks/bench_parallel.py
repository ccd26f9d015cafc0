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

from _report import bench_pair_parser, report_pair, run_bench_pair  # benchmarks/ is on sys.path when a script runs


def main() -> None:
    ap = bench_pair_parser(__doc__.split("\n")[0], n_predict=128, parallel=8, budget=64)
    args = ap.parse_args()
    walls, recs, load_before, model_lines = run_bench_pair(args, {f"-np {n}": ["-t", str(args.threads), "-np", str(n)]
                                                     for n in (1, args.parallel)})
    (a, wall1), (b, wall_n) = walls.items()
    ratio = round(wall1 / wall_n, 2)
    report_pair(args, recs[a], recs[b], load_before,
                {"threads": args.threads, "wall_s_np1": round(wall1, 2),
                 f"wall_s_np{args.parallel}": round(wall_n, 2), "ratio": ratio},
                f"-np 1: {wall1:.1f} s · -np {args.parallel}: {wall_n:.1f} s · ratio {ratio:.2f}×", model_lines)

if __name__ == "__main__":
    main()
