"""Aggregate decode throughput of batched decoding: B sequences, one forward per step, one run.

For each engine, KV policy and batch size B, B sequences are prefilled with ragged prompts (each a few
tokens longer than the last, so their caches differ in length and, under R-KV, compress at different
steps), then decoded greedily for ``--steps`` steps with ``decode_batch`` and ``sample_batch`` (logits
stay on the device; only ids come back). Reported: aggregate decode tok/s (B × steps / seconds) and
its ratio to B = 1 of the same engine and policy. The largest batch's prompts are prefilled once per
policy (batched, in one forward; for ``full`` also one after another, both timed) and each batch size
decodes forks of the first B of them; with ``--shared-prompt`` B forks of the first one (best-of-N sampling,
as rescue's candidates), whose shared prompt ``--attention cascade`` attends as one group
(:mod:`zoomr.backends.torch.cascade`).

The issue's CPU targets: batch 8 ≥ 4× batch 1 for full KV, ≥ 3× for rkv and zoomr. Ratios come from one
run in one process; on a shared machine the absolute numbers move with the load (recorded in the JSON).

    python benchmarks/batch_throughput.py [-t 2] [--dtype auto|fp32|bf16] [--quant auto|none|ggml|int4|fp16|w8a8] [--batches 1 2 4 8 16] [--steps 16]
        [--warmup 2] [--policies full rkv zoomr zoomr-w64] [--attention per_seq padded cascade] [--shared-prompt]
        [--no-llamacpp] [--json out.json|-]

``zoomr`` at its defaults attends every position of these short runs (its 512-token window is not full yet);
``zoomr-w64 --warmup 224`` times ZoomR while it selects (window 64, blocks of 32 tokens).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from _report import engine_parser, write_json  # benchmarks/ is on sys.path when a script runs

from zoomr.backends.torch.model import ATTENTION_MODES


def prompts(tokenizer, base: int, n: int) -> list[list[int]]:
    text = " ".join(f"Step {i}: we add {i} apples to the basket and count them again." for i in range(400))
    ids = tokenizer.encode(text, add_bos=False, special=False)
    return [ids[:base + 3 * (b % 16)] for b in range(n)]


def decode_steps(step, seqs, first: list[int], steps: int, warm: int = 2) -> float:
    """Seconds for ``steps`` batched greedy decode steps (``step(seqs, tokens) -> logits``) after ``warm`` untimed ones."""
    from zoomr.backends.sampling import Sampler, SamplingParams, sample_batch

    samplers = [Sampler(SamplingParams(temperature=0.0)) for _ in seqs]
    tok = list(first)
    t = 0.0
    for i in range(warm + steps):
        if i == warm:
            t = time.perf_counter()
        logits = step(seqs, tok)
        tok = [int(x) for x in sample_batch(logits, samplers)[0]]
    return time.perf_counter() - t


def torch_rows(args, source) -> list[dict]:
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

    base = TorchBackend(source, device=args.device, dtype=args.dtype, n_ctx=4096, threads=args.threads,
                        quant=args.quant)
    model_line = base.describe_model()   # what --dtype/--quant auto resolved to
    print(model_line, file=sys.stderr)
    specs = {"full": None, "rkv": PolicySpec("rkv", 64), "zoomr": PolicySpec("zoomr"), "h2o": PolicySpec("h2o", 64),
             "snapkv": PolicySpec("snapkv", 64), "streaming": PolicySpec("streaming", 64), "sumr": PolicySpec("sumr"),
             # ZoomR that selects within a short run: the default window (512) holds these runs whole, so plain
             # "zoomr" measures its book-keeping with every position attended; with --warmup 224 the timed
             # steps see 5+ closed segments beyond a 64-token window, two of them zoomed in
             "zoomr-w64": PolicySpec("zoomr", window=64, segment_tokens=32)}
    rows = []
    nmax = max(args.batches)
    for policy in args.policies:
        be = base.with_cache_factory(None if specs[policy] is None else PolicyCacheFactory(specs[policy]))
        ps = prompts(be.tokenizer, args.prompt_tokens, nmax)
        prefill = {"prefill_tokens": sum(map(len, ps))}
        if policy == "full":
            seqs = [be.new_sequence() for _ in ps]
            t = time.perf_counter()
            for s, p in zip(seqs, ps):
                be.prefill(s, p)
            prefill["prefill_sequential_s"] = time.perf_counter() - t
            for s in seqs:
                be.free(s)
        # the prompts are prefilled once, batched; every batch size decodes forks of the first B of them
        roots = [be.new_sequence() for _ in ps]
        t = time.perf_counter()
        first = [int(x) for x in np.argmax(be.prefill_batch(roots, ps), axis=-1)]
        prefill["prefill_batched_s"] = time.perf_counter() - t
        print(json.dumps({"policy": policy, **prefill}), file=sys.stderr, flush=True)
        for attention in args.attention:
            ref = None
            for B in args.batches:
                # --shared-prompt: B forks of the first prompt (best-of-N sampling, rescue's candidates)
                seqs = [be.fork(roots[0]) for _ in range(B)] if args.shared_prompt else [be.fork(r) for r in roots[:B]]

                def step(ss, tok, be=be, attention=attention):
                    return be.forward_batch(ss, [[t] for t in tok], attention=attention)

                sec = decode_steps(step, seqs, first[:B], args.steps, args.warmup)
                row = {"engine": "torch", "dtype": args.dtype, "quant": args.quant, "model_line": model_line,
                       "policy": policy,
                       "attention": attention, "batch": B,
                       "decode_tok_s": B * args.steps / sec,
                       "attended_max": max(s.cache.stats().active_tokens for s in seqs),
                       "written_max": max(s.cache.stats().full_tokens for s in seqs)}
                ref = ref or row["decode_tok_s"]
                row["vs_batch1"] = row["decode_tok_s"] / ref
                if B == nmax and attention == args.attention[0]:
                    row.update(prefill)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                for s in seqs:
                    be.free(s)
    return rows


def llamacpp_rows(args, source) -> list[dict]:
    from zoomr.backends.llamacpp.engine import LlamaCppBackend

    be = LlamaCppBackend(source, n_ctx=512, threads=args.threads, n_gpu_layers=0, policy="full",
                         max_sequences=max(args.batches))
    rows, ref = [], None
    try:
        for B in args.batches:
            ps = prompts(be.tokenizer, args.prompt_tokens, B)
            seqs = [be.new_sequence() for _ in ps]
            t = time.perf_counter()
            logits = be.prefill_batch(seqs, ps)
            row = {"engine": "llamacpp", "dtype": "gguf", "policy": "full", "attention": "llama.cpp", "batch": B,
                   "prefill_batched_s": time.perf_counter() - t, "prefill_tokens": sum(map(len, ps))}
            first = [int(x) for x in np.argmax(logits, axis=-1)]
            sec = decode_steps(be.decode_batch, seqs, first, args.steps, args.warmup)
            row["decode_tok_s"] = B * args.steps / sec
            ref = ref or row["decode_tok_s"]
            row["vs_batch1"] = row["decode_tok_s"] / ref
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            for s in seqs:
                be.free(s)
    finally:
        be.close()
    return rows


def main() -> None:
    ap = engine_parser(__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before the timed ones (tokens)")
    ap.add_argument("--prompt-tokens", type=int, default=176,
                    help="shortest prompt (tokens); R-KV B=64 compresses at 192 attended, inside the timed steps")
    ap.add_argument("--policies", nargs="+", default=["full", "rkv", "zoomr"])
    ap.add_argument("--attention", nargs="+", default=["per_seq"], choices=[m for m in ATTENTION_MODES if m != "auto"],
                    help="forward_batch's attention modes to time (cascade: forks of one prompt as one group; "
                         "pair it with --shared-prompt)")
    ap.add_argument("--shared-prompt", action="store_true",
                    help="torch: every sequence of a batch is a fork of the same prompt (best-of-N) instead of its own")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", default=None, help="write the record here ('-': stdout)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from zoomr.backends.models import resolve_model

    source = resolve_model(args.model)
    load0 = os.getloadavg()
    rows = torch_rows(args, source)
    if not args.no_llamacpp and source.kind == "gguf":
        rows += llamacpp_rows(args, source)
    record = {"model": source.name, "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
              "shared_prompt": args.shared_prompt,
              "cpus": os.cpu_count(),
              "load_avg_start": load0, "load_avg_end": os.getloadavg(), "rows": rows}
    print(f"{'engine':9} {'dtype':5} {'policy':9} {'attention':9} {'B':>3} {'tok/s':>8} {'×B=1':>6} {'attended':>9}",
          file=sys.stderr)
    for r in rows:
        kv = f"{r['attended_max']}/{r['written_max']}" if "attended_max" in r else ""
        print(f"{r['engine']:9} {r['dtype']:5} {r['policy']:9} {r['attention']:9} {r['batch']:>3} "
              f"{r['decode_tok_s']:8.1f} {r['vs_batch1']:6.2f} {kv:>9}", file=sys.stderr)
    write_json(record, args.json)


if __name__ == "__main__":
    main()
