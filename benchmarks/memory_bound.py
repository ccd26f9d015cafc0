"""Memory stays within its bound over long runs: the process's peak RSS while one sequence generates N tokens,
per KV policy, a short run against a long one.

Not a test: RSS depends on the machine, torch's allocator and the libraries loaded. Each run is a fresh
subprocess (this script with ``--child``), so no run inherits another's heap: it loads the model
(``zoomr.load``, the policy at ``--budget`` B), resets the kernel's high-water mark (``/proc/self/clear_refs``
← 5, Linux 4.0+: the model load's own peak does not hide what generation adds), generates exactly N tokens
(``zoomr.solve``, ``ignore_eos``) on GSM8K's first problem, then reads its peak RSS (``VmHWM`` of
``/proc/self/status``; where that is missing, ``getrusage``'s ``ru_maxrss``, which then includes the load).

Rows: every *bounded* policy of the registry (one with a ``--budget`` knob: streaming, h2o, snapkv, rkv,
keydiff, and any policy registered later with a budget), each at ``--short`` and ``--long`` tokens (default
512 and 8192, both runs with the same ``-c``, so positional tables are alike). ``growth_pct`` = (peak RSS long
− peak RSS short) / peak RSS short; the target is ≤ 5 %. ``within_long_run_growth_pct``: the long run's own
peak from ``--short`` tokens to its end (its peak is sampled at every power of two,
``long_peak_mib_at_tokens``), which a heap left large by the model load cannot hide or inflate. With ``--all`` the policies that size themselves
(full, sumr, zoomr) run too: their K/V grows with the tokens by design (full KV on the device, SumR/ZoomR's
host store), so their row also gives ``kv_growth_mib`` (the growth of the K/V bytes they report,
``device_kv_bytes`` + ``host_kv_bytes``; on a CPU both are RAM) and ``unexplained_mib`` = RSS growth − K/V
growth, which is what should stay near 0.

    python benchmarks/memory_bound.py [-t 2] [--budget 64] [--short 512] [--long 8192] [--all]
        [--policies rkv,h2o] [--json out.json|-]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import engine_parser, write_json  # noqa: E402

MIB = 1 << 20
TARGET_PCT = 5.0


def bounded_policies() -> list[str]:
    """The registry's policies with a ``--budget`` knob, in table order (a later-registered one joins)."""
    from zoomr.kvstore.registry import REGISTRY

    return [name for name, info in REGISTRY.items() if info.budgeted]


def self_sizing_policies() -> list[str]:
    from zoomr.kvstore.registry import REGISTRY

    return [name for name, info in REGISTRY.items() if not info.budgeted]


def _status_kib(field: str) -> int | None:
    """A ``VmXxx:`` field of /proc/self/status in KiB, or None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process to its current RSS; False where the OS cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> tuple[int, str]:
    """(peak RSS in bytes, which counter): VmHWM, else ru_maxrss (KiB on Linux, bytes on macOS)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024, "VmHWM"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss"


def child(args) -> None:
    """One run: load, reset the peak, generate ``args.tokens`` tokens, print one JSON line."""
    import torch

    import zoomr
    from zoomr.evaluation.datasets import load_problems
    from zoomr.kvstore.registry import REGISTRY

    torch.set_num_threads(args.threads)
    knobs = {"budget": args.budget} if REGISTRY[args.policy].budgeted else {}
    model = zoomr.load(args.model, policy=args.policy, ctx_size=args.ctx_size, threads=args.threads,
                       device=args.device, dtype=args.dtype, quant=args.quant, **knobs)
    _, (problem,) = load_problems("gsm8k", 1)
    rss_loaded = (_status_kib("VmRSS") or 0) * 1024
    reset = reset_peak()
    curve, count = {}, [0]

    def on_token(_text: str) -> None:   # the peak so far at every power of two: where growth starts, if it does
        count[0] += 1
        if count[0] >= 64 and count[0] & (count[0] - 1) == 0:
            curve[count[0]] = round(peak_rss_bytes()[0] / MIB, 1)

    t = time.perf_counter()
    result = zoomr.solve(model, problem.question, n_predict=args.tokens, ignore_eos=True, on_token=on_token)
    seconds = time.perf_counter() - t
    peak, counter = peak_rss_bytes()
    kv = result.kv
    print(json.dumps({"policy": args.policy, "tokens": len(result.token_ids), "peak_rss_bytes": peak,
                      "rss_after_load_bytes": rss_loaded, "peak_counter": counter, "peak_reset_after_load": reset,
                      "device_kv_bytes": kv.device_kv_bytes, "host_kv_bytes": kv.host_kv_bytes,
                      "policy_state_bytes": kv.policy_state_bytes, "peak_active_tokens": kv.peak_active_tokens,
                      "full_tokens": kv.full_tokens, "generate_s": round(seconds, 1), "peak_mib_at_tokens": curve,
                      "model": model.describe()}))


def run_child(args, policy: str, tokens: int) -> dict:
    """One ``--child`` run in a fresh interpreter. Exits (naming the run) when it fails."""
    cmd = [sys.executable, __file__, "--child", "--policy", policy, "--tokens", str(tokens), "-t", str(args.threads),
           "--budget", str(args.budget), "-c", str(args.ctx_size), "--device", args.device, "--dtype", args.dtype,
           "--quant", args.quant] + (["-m", args.model] if args.model else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        sys.exit(f"{policy} at {tokens} tokens failed (exit {r.returncode}): {r.stderr.strip()[-600:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def row(policy: str, short: dict, long: dict, bounded: bool) -> dict:
    """The comparison of one policy's two runs (MiB, %)."""
    growth = long["peak_rss_bytes"] - short["peak_rss_bytes"]
    kv = lambda r: r["device_kv_bytes"] + r["host_kv_bytes"]  # noqa: E731
    out = {"policy": policy, "bounded": bounded,
           "short_tokens": short["tokens"], "long_tokens": long["tokens"],
           "peak_rss_short_mib": round(short["peak_rss_bytes"] / MIB, 1),
           "peak_rss_long_mib": round(long["peak_rss_bytes"] / MIB, 1),
           "rss_after_load_mib": [round(short["rss_after_load_bytes"] / MIB, 1),
                                  round(long["rss_after_load_bytes"] / MIB, 1)],
           "growth_mib": round(growth / MIB, 1),
           "growth_pct": round(100 * growth / short["peak_rss_bytes"], 2),
           "kv_growth_mib": round((kv(long) - kv(short)) / MIB, 1),
           "unexplained_mib": round((growth - (kv(long) - kv(short))) / MIB, 1),
           "peak_active_tokens": [short["peak_active_tokens"], long["peak_active_tokens"]],
           "generate_s": [short["generate_s"], long["generate_s"]],
           "long_peak_mib_at_tokens": long["peak_mib_at_tokens"],
           "within_long_run_growth_pct": _within(long["peak_mib_at_tokens"], short["tokens"])}
    if bounded:
        out["within_target"] = out["growth_pct"] <= TARGET_PCT
    return out


def _within(curve: dict, tokens: int) -> float | None:
    """Growth (%) of the long run's own peak from ``tokens`` generated to its end: blind to what the model load
    left in the heap, which a separate short run's peak may include (the peak is reset to the RSS after load)."""
    at = {int(k): v for k, v in curve.items()}
    if tokens not in at or not at:
        return None
    return round(100 * (at[max(at)] - at[tokens]) / at[tokens], 2)


def cpu_kind() -> str:
    """The CPU's model name and its widest vector extensions (avx512*, avx2) from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    vector = sorted(f for f in set(flags) if f.startswith("avx512") or f == "avx2")
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(vector) or 'no avx2'}"


def main() -> None:
    ap = engine_parser(__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=64, help="B of the bounded policies (tokens)")
    ap.add_argument("--short", type=int, default=512, help="tokens of the reference run")
    ap.add_argument("--long", type=int, default=8192, help="tokens of the long run")
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="-c of every run (default --long + 512)")
    ap.add_argument("--policies", default=None, help="comma-separated (default: every bounded policy)")
    ap.add_argument("--all", action="store_true", help="also the policies that size themselves (full, sumr, zoomr)")
    ap.add_argument("--json", default=None, help="write the record here (- for stdout)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ctx_size is None:
        args.ctx_size = args.long + 512
    if args.child:
        child(args)
        return
    bounded = bounded_policies()
    names = args.policies.split(",") if args.policies else bounded + (self_sizing_policies() if args.all else [])
    load_before = os.getloadavg()[0]
    rows = []
    for name in names:
        short, long = run_child(args, name, args.short), run_child(args, name, args.long)
        rows.append(row(name, short, long, name in bounded))
        r = rows[-1]
        print(f"{name:>10}: {r['peak_rss_short_mib']:7.1f} MiB at {r['short_tokens']} tokens, "
              f"{r['peak_rss_long_mib']:7.1f} MiB at {r['long_tokens']}: {r['growth_pct']:+6.2f} % "
              f"(K/V {r['kv_growth_mib']:+.1f} MiB, unexplained {r['unexplained_mib']:+.1f} MiB)", file=sys.stderr)
    record = {"cpu": cpu_kind(), "threads": args.threads, "device": args.device, "dtype": args.dtype,
              "quant": args.quant, "budget": args.budget, "ctx_size": args.ctx_size, "short": args.short,
              "long": args.long, "target_pct": TARGET_PCT, "model_line": short["model"],
              "peak_counter": short["peak_counter"], "peak_reset_after_load": short["peak_reset_after_load"],
              "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "rows": rows,
              "bounded_within_target": all(r["within_target"] for r in rows if r["bounded"])}
    write_json(record, args.json)


if __name__ == "__main__":
    main()
