"""Score-ranked policies and zoomr on both backends: eviction decisions over the same tokens, and llama.cpp's
decode cost.

Part 1 (issue 33's target: identical for >= 95% of evictions): for each policy and GSM8K test problem,
llama.cpp generates ``-n`` greedy tokens; then the torch backend (fp32, ``--selection shared``) and llama.cpp
are fed that same prompt and text one token at a time and their evictions compared
(:func:`zoomr.evaluation.eviction_trace.compare_evictions`): whole decisions, and evicted positions (what a
decision that cuts 128 positions at once comes to). For zoomr a decision is a recompute's drop; the positions it
brings back are the store's.

Part 2 (target: llama.cpp h2o and rkv at B = 64 decode >= 0.8x llama.cpp full at the same length): decode
tokens/s of each policy on llama.cpp against ``full`` after the same prompt, engines taking turns over
``--repeats`` rounds (median).

    python benchmarks/policy_parity.py [--problems 3] [-n 512] [--budget 64] [--zoomr-window 128] [-t 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

POLICIES = ("h2o", "snapkv", "rkv", "keydiff", "zoomr")


def knobs_of(policy: str, budget: int, zoomr_window: int) -> dict:
    """The knobs each policy runs with: ``--budget`` for the score-ranked ones (one selection for all layers
    and heads), ``--window`` for zoomr (its selection is one already: every layer and head votes)."""
    return {"window": zoomr_window} if policy == "zoomr" else {"budget": budget, "selection": "shared"}


def greedy(be, ids: list[int], n: int) -> tuple[list[int], float]:
    """``n`` greedy tokens (EOS ignored) after ``ids`` on a fresh sequence; (tokens, decode tok/s)."""
    seq = be.new_sequence()
    tok, out = int(np.argmax(be.prefill(seq, ids))), []
    t0 = time.perf_counter()
    for _ in range(n):
        out.append(tok)
        tok = int(np.argmax(be.decode(seq, tok)))
    rate = n / (time.perf_counter() - t0)
    be.free(seq)
    return out, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=3)
    ap.add_argument("-n", type=int, default=512)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--zoomr-window", type=int, default=128, help="zoomr's --window (tokens)")
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch

    from zoomr.backends.llamacpp.engine import LlamaCppBackend
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.evaluation.cells import problem_prompt
    from zoomr.evaluation.datasets import load_problems
    from zoomr.evaluation.eviction_trace import compare_evictions
    from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

    torch.set_num_threads(a.threads)
    src = resolve_model(None)
    policies = [p for p in a.policies.split(",") if p]
    _, problems = load_problems("gsm8k", limit=a.problems)
    out = {"budget": a.budget, "n": a.n, "threads": a.threads, "parity": {}, "speed": {}}
    torch_be = TorchBackend(src, device="cpu", dtype="fp32", n_ctx=a.n + 1024)
    for policy in policies:
        knobs = knobs_of(policy, a.budget, a.zoomr_window)
        llama = LlamaCppBackend(src, n_ctx=a.n + 1024, threads=a.threads, policy=policy,
                                **{k: v for k, v in knobs.items() if k != "selection"})
        shared = torch_be.with_cache_factory(PolicyCacheFactory(PolicySpec(policy, **knobs)))
        ev = same = pos = agreed = 0
        for prob in problems:
            prompt = problem_prompt(llama.tokenizer, prob, a.n + 1024)
            text, _ = greedy(llama, prompt, a.n)
            agree = compare_evictions(shared, llama, prompt, text)
            ev, same = ev + agree.evictions, same + agree.identical
            pos, agreed = pos + agree.positions, agreed + agree.agreed
        row = out["parity"][policy] = {"evictions": ev, "identical": same, "share": same / ev if ev else 1.0,
                                       "evicted_positions": pos, "agreed_positions": agreed,
                                       "position_share": agreed / pos if pos else 1.0}
        print(f"{policy}: {same}/{ev} evictions identical ({row['share']:.3f}); {agreed}/{pos} evicted positions "
              f"agreed ({row['position_share']:.3f})", flush=True)
        llama.close()

    engines = {p: LlamaCppBackend(src, n_ctx=a.n + 1024, threads=a.threads, policy=p, **(
        {} if p == "full" else {k: v for k, v in knobs_of(p, a.budget, a.zoomr_window).items() if k != "selection"}))
        for p in ("full", *policies)}
    prompt = problem_prompt(engines["full"].tokenizer, problems[0], a.n + 1024)
    rates: dict[str, list[float]] = {p: [] for p in engines}
    for r in range(a.repeats):
        order = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
        for p in order:
            rates[p].append(greedy(engines[p], prompt, a.n)[1])
    full = statistics.median(rates["full"])
    for p, rs in rates.items():
        m = statistics.median(rs)
        out["speed"][p] = {"decode_tok_s": m, "vs_full": m / full}
        print(f"llama.cpp {p}: {m:.1f} tok/s decode, {m / full:.2f}x full", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
