"""zoomr's llama.cpp engine against llama-cpp-python's own ``Llama.generate``, and fork costs, in one run.

Part 1, decode throughput: the same GGUF model, chat prompt, thread count and greedy decoding. The
engine runs with streaming eviction (``--budget`` B, 4 sinks, window B − 4, its default eviction
buffer of 16: the cache moves between B and B + 16 cells and is shifted after each eviction) and, for
reference, with full KV; llama-cpp-python runs its high-level generator (full KV, its C sampler
chain). Engines take turns over ``--repeats`` rounds (order rotated each round) and the median is
reported, so a machine busy with other work slows all of them alike; tokens per CPU second of this
process are reported beside wall-clock tokens/s, since descheduling does not count there. One thread
by default: on a small shared machine ggml's spinning thread barrier makes multi-thread timings swing
by orders of magnitude when another process takes a core.

Part 2, fork cost of the two KV layouts the engine can use: a unified cache (``full``: a fork
shares cells) and one stream per sequence (evicting policies: a fork copies the parent's stream).
Reported per fork (CPU time): ``llama_memory_seq_cp`` and the extra time of the child's first decode over a
plain decode (where llama.cpp performs a stream copy), at several prefix lengths.

    python benchmarks/llamacpp_speed.py [-m MODEL.gguf] [-n 256] [-t 1] [--budget 64] [--repeats 3] [--scored h2o,rkv,zoomr]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def chat_prompt(tokenizer) -> list[int]:
    """The ``zoomr solve examples/problem.txt`` prompt."""
    from pathlib import Path

    from zoomr.prompts import solve_prompt

    problem = (Path(__file__).resolve().parents[1] / "examples" / "problem.txt").read_text().strip()
    return solve_prompt(tokenizer, problem)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) since ``t0``."""
    wall, cpu = _clocks()
    return wall - t0[0], cpu - t0[1]


def engine_decode_s(be, ids: list[int], n: int) -> tuple[float, float]:
    """(wall, CPU) seconds for ``n`` greedy decode steps (EOS ignored) after prefilling ``ids``, on a fresh
    sequence."""
    seq = be.new_sequence()
    tok = int(np.argmax(be.prefill(seq, ids)))
    t0 = _clocks()
    for _ in range(n):
        tok = int(np.argmax(be.decode(seq, tok)))
    dt = _since(t0)
    be.free(seq)
    return dt


def llama_generate_s(llm, ids: list[int], n: int) -> tuple[float, float]:
    """(wall, CPU) seconds from the first to the (n+1)-th token of ``Llama.generate`` (greedy): n decode steps."""
    t0 = _clocks()
    for i, _tok in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
        if i == 0:
            t0 = _clocks()
        elif i == n:
            return _since(t0)
    raise RuntimeError("generator ended early")


def amx_note() -> str:
    """Where llama.cpp's AMX layouts fault here, both llama.cpp rows run without them: the header says so."""
    from zoomr.backends.llamacpp.amx_probe import known_verdict

    return ", llama.cpp without its AMX layouts (they fault on this machine)" if known_verdict() is False else ""


def throughput(src, a) -> list[dict]:
    import llama_cpp

    from zoomr.backends.llamacpp.engine import LlamaCppBackend
    from zoomr.backends.llamacpp.policies import STREAMING_BUFFER
    from zoomr.backends.llamacpp.runtime import llama_defaults

    evict = LlamaCppBackend(src, n_ctx=a.budget + STREAMING_BUFFER, threads=a.threads, policy="streaming",
                            budget=a.budget, max_sequences=1)
    ids = chat_prompt(evict.tokenizer)
    full = LlamaCppBackend(src, n_ctx=len(ids) + a.n + 8, threads=a.threads, max_sequences=1)
    with llama_defaults(src.path):  # the same llama.cpp buffer types as LlamaCppBackend's (AMX probed)
        llm = llama_cpp.Llama(model_path=str(src.path), n_ctx=len(ids) + a.n + 8, n_threads=a.threads,
                              n_threads_batch=a.threads, verbose=False)
    # the score-ranked policies and zoomr read queries and keys through cb_eval: their rows show what that costs
    # (zoomr sized by its window and segments, not a budget; its store and active sequences take two ids)
    knobs = {p: ({"window": a.zoomr_window} if p == "zoomr" else {"budget": a.budget}) for p in a.scored}
    scored = {p: LlamaCppBackend(src, n_ctx=len(ids) + a.n + 8, threads=a.threads, policy=p, **knobs[p],
                                 max_sequences=2 if p == "zoomr" else 1) for p in a.scored}
    runs = {
        f"zoomr llamacpp, streaming B={a.budget}": lambda: engine_decode_s(evict, ids, a.n),
        **{f"zoomr llamacpp, {p} {'w' if p == 'zoomr' else 'B'}={next(iter(knobs[p].values()))}":
           (lambda be=be: engine_decode_s(be, ids, a.n)) for p, be in scored.items()},
        "zoomr llamacpp, full KV": lambda: engine_decode_s(full, ids, a.n),
        "llama-cpp-python Llama.generate": lambda: llama_generate_s(llm, ids, a.n),
    }
    for fn in runs.values():  # warm-up: page in weights, build graphs
        fn()
    times = {k: [] for k in runs}
    names = list(runs)
    for r in range(a.repeats):
        # rotate the order every round: whichever engine runs right after another inherits its cache and
        # frequency state, and a fixed order biased one engine by up to 10 % on a busy 2-core machine
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(runs[k]())
    def rate(k: str, clock: int) -> float:
        return a.n / statistics.median(t[clock] for t in times[k])

    base = "llama-cpp-python Llama.generate"
    rows = []
    for k in times:
        rows.append({"engine": k, "decode_tok_s": round(rate(k, 0), 2),
                     "vs_llama_generate": round(rate(k, 0) / rate(base, 0), 3),
                     "cpu_tok_s": round(rate(k, 1), 2), "vs_llama_generate_cpu": round(rate(k, 1) / rate(base, 1), 3),
                     "runs_tok_s": [round(a.n / t[0], 1) for t in times[k]]})
    for be in (evict, full, *scored.values()):
        be.close()
    return rows


def fork_cost(src, a) -> list[dict]:
    """Per-fork cost of both layouts at several prefix lengths: medians over 8 forks of CPU time (this process,
    one thread, so a busy machine does not inflate it)."""
    from zoomr.backends.llamacpp.engine import LlamaCppBackend

    rows = []
    for prefix in a.fork_prefix:
        text = " ".join(f"Step {i}: we add {i} apples to the basket and count them again." for i in range(600))
        layouts = {
            "unified (full: cells shared)": dict(policy="full", n_ctx=prefix + 64),
            "streams (streaming: stream copied)": dict(policy="streaming", budget=prefix + 32, n_ctx=prefix + 64),
        }
        for name, kw in layouts.items():
            be = LlamaCppBackend(src, threads=a.threads, max_sequences=5, **kw)
            ids = be.tokenizer.encode(text, special=False)[:prefix]
            parent = be.new_sequence()
            be.prefill(parent, ids)
            plain, cp, first = [], [], []
            for _ in range(8):
                t = time.process_time()
                be.decode(parent, 7)
                plain.append(time.process_time() - t)
                t = time.process_time()
                child = be.fork(parent)
                cp.append(time.process_time() - t)
                t = time.process_time()
                be.decode(child, 7)
                first.append(time.process_time() - t)
                be.free(child)
            rows.append({"layout": name, "prefix_tokens": prefix, "kv_cells": be.kv_cells,
                         "seq_cp_ms": round(statistics.median(cp) * 1e3, 3),
                         "first_decode_extra_ms": round((statistics.median(first) - statistics.median(plain)) * 1e3, 2),
                         "plain_decode_ms": round(statistics.median(plain) * 1e3, 2)})
            be.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("-n", type=int, default=256, help="decode steps timed per run (tokens)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scored", type=lambda s: [x for x in s.split(",") if x], default=["h2o", "snapkv", "rkv", "keydiff"],
                    help="score-ranked policies (and zoomr) timed beside streaming and full (comma list; empty: none)")
    ap.add_argument("--zoomr-window", type=int, default=256, help="zoomr's --window in the zoomr row (tokens)")
    ap.add_argument("--fork-prefix", type=lambda s: [int(x) for x in s.split(",")], default=[64, 512, 2048],
                    help="prefix lengths for the fork-cost table (tokens, comma-separated)")
    ap.add_argument("--skip", choices=["throughput", "fork"], default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()

    from zoomr.backends.models import resolve_model

    src = resolve_model(a.model)
    out = {}
    if a.skip != "throughput":
        out["throughput"] = throughput(src, a)
        print(f"decode throughput, {a.n} greedy tokens, {a.threads} threads, median of {a.repeats} "
              "(wall clock; per CPU second of this process, which a busy machine disturbs less)"
              f"{amx_note()}:")
        for r in out["throughput"]:
            print(f"  {r['engine']:<36} {r['decode_tok_s']:7.2f} tok/s {r['vs_llama_generate']:.3f}×  |  "
                  f"{r['cpu_tok_s']:7.2f} tok/CPU-s {r['vs_llama_generate_cpu']:.3f}×  runs {r['runs_tok_s']}")
    if a.skip != "fork":
        out["fork"] = fork_cost(src, a)
        print("fork cost per child (CPU time, median of 8):")
        for r in out["fork"]:
            print(f"  {r['layout']:<36} prefix {r['prefix_tokens']:>5}  cells {r['kv_cells']:>6}  seq_cp "
                  f"{r['seq_cp_ms']:.3f} ms  first decode +{r['first_decode_extra_ms']:.2f} ms "
                  f"(plain {r['plain_decode_ms']:.2f} ms)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
