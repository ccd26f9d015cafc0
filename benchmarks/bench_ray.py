"""Wall time of ``zoomr bench --ray auto`` with W workers against a local ``zoomr bench`` on the same cells.

Runs the same bench twice in one invocation, each a fresh ``zoomr bench`` process (model loads and, for Ray,
starting and stopping the local Ray instance included): locally with ``-t`` threads and ``-np N``, then on
``--ray-workers W`` workers of ``-t / W`` threads each with the same ``-np N``; the records are compared field
by field (timings and worker fields aside). Both runs get the same cores, so on one machine the ratio says what
sharding costs or buys there; on a GPU machine give ``--device cuda`` and W = the GPUs.

    python benchmarks/bench_ray.py [--limit 8] [-n 64] [-np 4] [--workers 2] [--policies full,rkv] [--budget 32]
        [-t 2] [--device cpu] [--dtype fp32] [--json out.json|-]
"""

from __future__ import annotations

import collections
import os

from _report import bench_pair_parser, report_pair, run_bench_pair  # benchmarks/ is on sys.path when a script runs


def main() -> None:
    ap = bench_pair_parser(__doc__.split("\n")[0], n_predict=64, parallel=4, budget=32)
    ap.add_argument("--workers", type=int, default=2, help="Ray workers")
    args = ap.parse_args()
    per_worker = max(1, args.threads // args.workers)
    walls, recs, load_before, model_lines = run_bench_pair(args, {
        "local": ["-t", str(args.threads), "-np", str(args.parallel)],
        "--ray auto": ["-t", str(per_worker), "-np", str(args.parallel), "--ray", "auto", "--ray-workers",
                       str(args.workers)]})
    wall_local, wall_ray = walls["local"], walls["--ray auto"]
    recs_local, recs_ray = recs["local"], recs["--ray auto"]
    cells = collections.Counter(r["worker_pid"] for r in recs_ray)
    ratio = round(wall_local / wall_ray, 2)
    report_pair(args, recs_local, recs_ray, load_before,
                {"threads_local": args.threads, "workers": args.workers, "threads_per_worker": per_worker,
                 "cpus": os.cpu_count(), "cells_per_worker": sorted(cells.values()),
                 "wall_s_local": round(wall_local, 2), "wall_s_ray": round(wall_ray, 2),
                 "ratio_local_over_ray": ratio},
                f"local -t {args.threads} -np {args.parallel}: {wall_local:.1f} s · --ray auto, {args.workers} "
                f"workers × -t {per_worker}: {wall_ray:.1f} s · local/ray {ratio:.2f}×", model_lines)

if __name__ == "__main__":
    main()
