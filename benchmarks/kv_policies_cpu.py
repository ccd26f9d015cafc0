"""ZoomR on CPU: selection overhead vs full KV, and the active/full KV ratio over a long generation.

Not a test: numbers depend on the machine and its load. Three parts, on the embedded model (fp32):

1. Long run. A MATH500 problem is the prompt; the "generation" is teacher-forced: human-written
   MATH500 solutions concatenated up to ``--tokens`` tokens (default 4096), fed one sentence per forward.
   Each forward ends at a semantic boundary, so ZoomR recomputes once per forward, as it would once per
   sentence when decoding token by token. Records the active/full KV ratio as the text grows and the
   cost of every recompute: votes + building I_f (end of forward) + applying the selection to every
   layer's active set (start of the next forward).
2. Decode at that context: ``--decode`` forced tokens one at a time on full KV (the plain on-device
   cache, prefilled with the same tokens) and on ZoomR, interleaved step by step so machine load hits
   both alike: time per token, and time spent inside the KV-cache code (outside the model's matmuls).
3. ``--synthetic N`` (optional): random K/V at the embedded model's shape, N positions in ~60-token
   paragraphs: recompute cost at a larger context.

    overhead = (ZoomR cache s/token − full cache s/token, steps without recompute
                + recompute s / tokens per recompute) / full decode s/token

    python benchmarks/kv_policies_cpu.py [--tokens 4096] [--decode 32] [--synthetic 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

class TimedCache:
    """Wraps a KV cache and adds up the seconds spent in its own code (update + end_forward).

    Attributes:
        seconds: total seconds inside the cache.
        forward_s: seconds inside the cache during the last forward.
        end_s: seconds of the last ``end_forward``.
    """

    def __init__(self, cache):
        self.cache = cache
        self.seconds = self.forward_s = self.end_s = 0.0

    @property
    def n_tokens(self):
        return self.cache.n_tokens

    def update(self, layer, q, k, v):
        t = time.perf_counter()
        out = self.cache.update(layer, q, k, v)
        dt = time.perf_counter() - t
        self.seconds += dt
        self.forward_s = dt if layer == 0 else self.forward_s + dt
        return out

    def end_forward(self, token_ids, text):
        t = time.perf_counter()
        self.cache.end_forward(token_ids, text)
        self.end_s = time.perf_counter() - t
        self.seconds += self.end_s
        self.forward_s += self.end_s

    def stats(self):
        return self.cache.stats()


def time_applies(active) -> list[float]:
    """Record the seconds of every selection applied to ``active`` (the lazy half of a recompute)."""
    applied: list[float] = []
    inner = active._apply

    def timed(layer):
        t = time.perf_counter()
        inner(layer)
        applied.append(time.perf_counter() - t)

    active._apply = timed
    return applied


def forced_ids(tokenizer, n_tokens: int) -> tuple[str, list[int]]:
    """(a MATH500 problem, ids of following problems' solutions concatenated, ``n_tokens`` long)."""
    from zoomr.evaluation.datasets import records

    rows = records("math500")  # the shipped copy unless $ZOOMR_DATA overrides it
    text = ""
    for row in rows[1:]:
        text += row["solution"].strip() + "\n\n"
        if len(text) > 6 * n_tokens:   # MATH text runs ~3-4 chars per token: enough, then cut exactly
            break
    return rows[0]["problem"], tokenizer.encode(text)[:n_tokens]


def sentence_chunks(tokenizer, ids: list[int], longest: int = 64) -> list[list[int]]:
    """Split ids after every token that ends at a semantic boundary (or every ``longest`` tokens)."""
    from zoomr.kvstore.segments import ends_at_boundary

    chunks, cur, tail = [], [], ""
    for t in ids:
        cur.append(t)
        tail = (tail + tokenizer.decode([t]))[-8:]
        if ends_at_boundary(tail) or len(cur) >= longest:
            chunks.append(cur)
            cur = []
    return chunks + ([cur] if cur else [])


def long_run(backend, spec, prompt_ids, chunks, checkpoints):
    """Part 1: ZoomR over the sentence chunks; returns (sequence, timed cache, applies list, report)."""
    from zoomr.backends.torch.engine import TorchSequence
    from zoomr.kvstore.registry import PolicyCacheFactory

    cache = PolicyCacheFactory(spec)(backend)
    applied = time_applies(cache.active)
    timed = TimedCache(cache)
    seq = TorchSequence(timed)
    backend.prefill(seq, prompt_ids)
    n_prompt = len(prompt_ids)
    ends, ratio_at = [], {}
    t0 = time.perf_counter()
    for chunk in chunks:
        before = cache.policy.recomputes
        backend.prefill(seq, chunk)
        if cache.policy.recomputes > before:
            ends.append(timed.end_s)
        st = cache.stats()
        for c in checkpoints:
            if c not in ratio_at and st.full_tokens - n_prompt >= c:
                ratio_at[c] = round(st.full_tokens / st.active_tokens, 2)
    wall = time.perf_counter() - t0
    n_rec = max(1, len(ends))
    per_recompute = statistics.fmean(ends) + sum(applied) / n_rec if ends else 0.0
    tail = ends[-max(1, len(ends) // 4):]
    tail_applies = applied[-len(tail) * cache.ctx.n_layers:]
    report = {
        "generated_tokens": cache.n_tokens - n_prompt, "prompt_tokens": n_prompt, "forwards": len(chunks),
        "recomputes": len(ends), "tokens_per_recompute": round((cache.n_tokens - n_prompt) / n_rec, 1),
        "recompute_ms_mean": round(1e3 * per_recompute, 3),
        "recompute_ms_last_quarter": round(1e3 * (statistics.fmean(tail) + sum(tail_applies) / len(tail)), 3)
        if tail else None,
        "ratio_full_over_active_at": ratio_at,
        "final_kv": cache.stats().as_dict(),
        "wall_s": round(wall, 1),
    }
    return seq, timed, applied, report


def decode_compare(backend, zoomr_seq, zoomr_timed, applied, prompt_ids, forced, n_decode):
    """Part 2: full KV (prefilled with the same tokens) vs ZoomR, one forced token at a time, interleaved."""
    from zoomr.backends.torch.engine import TorchSequence

    full_timed = TimedCache(backend.new_sequence().cache)
    full = TorchSequence(full_timed)
    history = prompt_ids + forced
    for i in range(0, len(history), 512):
        backend.prefill(full, history[i:i + 512])
    steps = forced[-n_decode:][::-1]   # any tokens do: the same ones for both
    rows = {"full": [], "zoomr": []}
    for tok in steps:
        for name, seq, timed in (("full", full, full_timed), ("zoomr", zoomr_seq, zoomr_timed)):
            before = len(applied)
            rec = getattr(timed.cache, "policy", None)
            n_rec = rec.recomputes if rec else 0
            t = time.perf_counter()
            backend.decode(seq, tok)
            step = time.perf_counter() - t
            recomputed = rec is not None and (rec.recomputes > n_rec or len(applied) > before)
            rows[name].append((step, timed.forward_s, recomputed))
    out = {}
    for name, r in rows.items():
        plain = [x for x in r if not x[2]] or r
        out[name] = {"decode_ms_per_token": round(1e3 * statistics.median(x[0] for x in r), 3),
                     "cache_ms_per_token": round(1e3 * statistics.median(x[1] for x in plain), 3),
                     "context_tokens": len(history) + n_decode}
    return out


def synthetic(n_tokens: int, window: int) -> dict:
    """Part 3: recompute cost of ZoomR on a random store of ``n_tokens`` at the embedded model's shape."""
    from zoomr.kvstore.cache import PolicyKVCache
    from zoomr.kvstore.zoomr import ZoomRPolicy

    L, H, Hkv, d = 30, 9, 3, 64
    policy = ZoomRPolicy(window, 2, 2, "auto")
    cache = PolicyKVCache(policy, L, H, Hkv, d, torch.device("cpu"), torch.float32)
    applied = time_applies(cache.active)
    g = torch.Generator().manual_seed(0)
    chunk, ends, pos = 30, [], 0
    while pos < n_tokens:
        T = chunk if pos else 256
        for layer in range(L):
            cache.update(layer, torch.randn(H, T, d, generator=g), torch.randn(Hkv, T, d, generator=g),
                         torch.randn(Hkv, T, d, generator=g))
        text = "x" * 20 + (".\n\n" if (pos // chunk) % 2 else ".")    # a paragraph every ~60 tokens
        t = time.perf_counter()
        cache.end_forward([0] * T, text)
        if pos:
            ends.append(time.perf_counter() - t)
        pos += T
    tail = ends[-20:]
    tail_applies = applied[-20 * L:]
    st = cache.stats()
    return {"tokens": st.full_tokens, "segments": len(policy.tracker.segments),
            "recompute_ms_at_end": round(1e3 * (statistics.fmean(tail) + sum(tail_applies) / len(tail)), 3),
            "active_tokens": st.active_tokens, "ratio": round(st.full_tokens / st.active_tokens, 2)}


def run(a) -> int:
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.kvstore.registry import PolicySpec
    from zoomr.prompts import solve_prompt

    backend = TorchBackend(resolve_model(None), device="cpu", dtype=a.dtype, n_ctx=a.tokens + 1024,
                           threads=a.threads)
    tok = backend.tokenizer
    problem, forced = forced_ids(tok, a.tokens)
    ids = solve_prompt(tok, problem)
    chunks = sentence_chunks(tok, forced[:len(forced) - a.decode])
    spec = PolicySpec("zoomr", window=a.window)
    checkpoints = [c for c in (256, 512, 1024, 2048, 3072, 4096, 8192) if c <= a.tokens - a.decode]
    seq, timed, applied, long = long_run(backend, spec, ids, chunks, checkpoints)
    print(f"long run: {long['generated_tokens']} teacher-forced tokens after a {long['prompt_tokens']}-token prompt, "
          f"{long['forwards']} sentence forwards, {long['wall_s']} s")
    print(f"  recomputes {long['recomputes']} (one per {long['tokens_per_recompute']} tokens), "
          f"{long['recompute_ms_mean']} ms each (last quarter {long['recompute_ms_last_quarter']} ms)")
    print("  full/active KV: " + ", ".join(f"{k} tok → {v}×" for k, v in long["ratio_full_over_active_at"].items()))
    kv = long["final_kv"]
    print(f"  final: active {kv['active_tokens']} / full {kv['full_tokens']} tok, mean active "
          f"{kv['mean_active_tokens']}, {kv['segments']} segments ({kv['summaries_mode']}), AG "
          f"{kv['ag_mean']} ± {kv['ag_std']}")
    dec = decode_compare(backend, seq, timed, applied, ids, forced[:len(forced) - a.decode], a.decode)
    f, z = dec["full"], dec["zoomr"]
    per_token_sel = long["recompute_ms_last_quarter"] / long["tokens_per_recompute"]
    overhead = (z["cache_ms_per_token"] - f["cache_ms_per_token"] + per_token_sel) / f["decode_ms_per_token"]
    print(f"decode at {f['context_tokens']} tokens: full {f['decode_ms_per_token']} ms/token "
          f"(cache {f['cache_ms_per_token']} ms), zoomr {z['decode_ms_per_token']} ms/token "
          f"(cache {z['cache_ms_per_token']} ms)")
    print(f"  selection overhead: {100 * overhead:.2f}% of full decode time per token "
          f"(bookkeeping {z['cache_ms_per_token'] - f['cache_ms_per_token']:.3f} ms + recompute "
          f"{per_token_sel:.3f} ms amortized per token)")
    report = {"long_run": long, "decode": dec, "overhead_fraction": round(overhead, 4), "dtype": a.dtype,
              "threads": torch.get_num_threads()}
    if a.synthetic:
        report["synthetic"] = synthetic(a.synthetic, a.window)
        s = report["synthetic"]
        print(f"synthetic store: {s['tokens']} tokens, {s['segments']} segments: recompute "
              f"{s['recompute_ms_at_end']} ms, active {s['active_tokens']} → {s['ratio']}×")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="teacher-forced generated tokens")
    ap.add_argument("--decode", type=int, default=32, help="single-token decode steps timed at the end")
    ap.add_argument("--window", type=int, default=128, help="ZoomR recent window w (tokens)")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--synthetic", type=int, default=0, help="also time recomputes on a random store this long")
    ap.add_argument("--json", default=None)
    raise SystemExit(run(ap.parse_args()))


if __name__ == "__main__":
    main()
