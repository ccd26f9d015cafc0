"""Would ZoomR on llama.cpp save anything? Decode cost of a sequence holding a selection of a long cache's cells.

ZoomR on llama.cpp (issue 33) would keep every position in a *store* sequence and copy each recompute's
selection (prompt, summaries, zoomed-in paragraphs, recent window) into an *active* sequence with
``llama_memory_seq_cp``; decoding then runs on the active sequence. Its KV memory is the store's, all L cells,
so the only thing it could save is attention work. This measures whether it does: decode tokens/s of

- ``store``: a sequence holding all L cells (full KV at length L);
- ``selection``: a sequence holding S of those L cells (copied with ``seq_cp``; the pool still holds L);
- ``small``: a context holding only S cells (what an evicting policy at budget ≈ S costs),

with flash attention on and off, the three taking turns over ``--repeats`` rounds (median). If ``selection``
decodes like ``store`` and not like ``small``, llama.cpp attends over the whole pool and masks the rest, and
ZoomR there would cost full KV's memory and full KV's attention.

    python benchmarks/llamacpp_masked_attention.py [--lengths 2048,8192] [--selected 512] [-n 64] [-t 2] [--json -]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def selection_ranges(length: int, selected: int) -> list[tuple[int, int]]:
    """[p0, p1) position ranges of a ZoomR-like selection of ``selected`` cells out of ``length``: the first
    quarter as the prompt, the last half as the recent window, the rest as 8 scattered runs (summaries and
    zoomed-in paragraphs)."""
    prompt, window = selected // 4, selected // 2
    runs, run = 8, (selected - prompt - window) // 8
    gap = (length - prompt - window) // runs
    middle = [(prompt + i * gap, prompt + i * gap + run) for i in range(runs)]
    return [(0, prompt), *middle, (length - window, length)]


class Context:
    """One llama.cpp context over the model: ``cells`` KV cells in one unified pool, two sequence ids."""

    def __init__(self, model, cells: int, threads: int, flash: bool):
        import llama_cpp

        from zoomr.backends.llamacpp.batch import Batch

        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = cells, 512, 512, 2, True
        p.n_threads = p.n_threads_batch = threads
        p.no_perf = True
        p.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                             else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = llama_cpp.llama_init_from_model(model, p)
        if not self.ctx:
            raise SystemExit(f"llama.cpp cannot create a context of {cells} cells")
        self.mem, self.batch, self.lib = llama_cpp.llama_get_memory(self.ctx), Batch(512), llama_cpp

    def prefill(self, ids: list[int], seq: int) -> None:
        for i in range(0, len(ids), 512):
            self.batch.set_run(ids[i:i + 512], i, seq, False)
            if self.lib.llama_decode(self.ctx, self.batch.raw) != 0:
                raise SystemExit("llama_decode failed during prefill")

    def decode_rate(self, seq: int, pos0: int, n: int, token: int) -> float:
        """Decode ``n`` tokens on ``seq`` from position ``pos0``, then remove them; tokens/s."""
        t0 = time.perf_counter()
        for i in range(n):
            self.batch.set_rows([token], [pos0 + i], [seq])
            if self.lib.llama_decode(self.ctx, self.batch.raw) != 0:
                raise SystemExit("llama_decode failed during decode")
        rate = n / (time.perf_counter() - t0)
        self.lib.llama_memory_seq_rm(self.mem, seq, pos0, -1)
        return rate

    def close(self) -> None:
        self.batch.close()
        self.lib.llama_free(self.ctx)


def measure(model, n_vocab: int, length: int, selected: int, n: int, threads: int, flash: bool,
            repeats: int) -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(100, n_vocab - 100, length).tolist()
    pool = Context(model, length + n + 256, threads, flash)
    pool.prefill(ids, 0)
    for p0, p1 in selection_ranges(length, selected):
        pool.lib.llama_memory_seq_cp(pool.mem, 0, 1, p0, p1)
    small = Context(model, selected + n + 256, threads, flash)
    small.prefill(ids[-selected:], 0)
    cases = {"store": lambda: pool.decode_rate(0, length, n, ids[-1]),
             "selection": lambda: pool.decode_rate(1, length, n, ids[-1]),
             "small": lambda: small.decode_rate(0, selected, n, ids[-1])}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeats):
        for k in list(cases)[r % 3:] + list(cases)[:r % 3]:
            rates[k].append(cases[k]())
    pool.close()
    small.close()
    return {k: statistics.median(v) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192", help="cells in the store (tokens), comma-separated")
    ap.add_argument("--selected", type=int, default=512, help="cells in the selection (tokens)")
    ap.add_argument("-n", type=int, default=64, help="decode steps per round")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here (- for stdout)")
    a = ap.parse_args()

    import llama_cpp

    from zoomr.backends.llamacpp.runtime import load_model
    from zoomr.backends.models import resolve_model

    model = load_model(resolve_model(None).path, n_gpu_layers=0)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rows = []
    for flash in (True, False):
        for length in (int(x) for x in a.lengths.split(",")):
            r = measure(model, n_vocab, length, a.selected, a.n, a.threads, flash, a.repeats)
            row = {"flash_attn": flash, "length": length, "selected": a.selected,
                   **{f"{k}_tok_s": v for k, v in r.items()},
                   "selection_vs_store": r["selection"] / r["store"], "small_vs_store": r["small"] / r["store"]}
            rows.append(row)
            print(f"flash_attn {'on ' if flash else 'off'} L={length} S={a.selected}: store {r['store']:.1f} tok/s, "
                  f"selection {r['selection']:.1f} ({row['selection_vs_store']:.2f}x), small {r['small']:.1f} "
                  f"({row['small_vs_store']:.2f}x)", file=sys.stderr, flush=True)
    llama_cpp.llama_model_free(model)
    if a.json:
        text = json.dumps({"threads": a.threads, "n": a.n, "rows": rows}, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
