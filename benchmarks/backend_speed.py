"""Prefill and decode throughput of the torch backend (dense, int8, int4, fp16 weights) against llama-cpp-python.

Same model file, same prompt, same thread count, greedy decoding. Every engine is loaded once, then each of
``--rounds`` rounds gives every engine (llama.cpp first) a fresh sequence: all prefill the prompt, then they
decode ``--decode-tokens`` in turns of ``--block`` tokens (llama.cpp 16, torch int4 16, …, llama.cpp the next
16, …). A row's ratio to llama.cpp is taken within each round and the median over rounds is reported; the
short turns put every engine's tokens of a round in the same stretch of time, so a shared host whose speed
drifts from one second to the next moves both sides of a ratio together. The per-round figures are kept
in the JSON (``rounds``).

Rows: ``fp32``, ``fp16``, ``bf16`` (dense weights, ``--quant none``), ``int8`` (``--quant int8``) and ``int4``
(``--quant int4``: a Q4 GGUF's own blocks), the last two at ``--dtype auto``, ``int4c`` (``int4`` with
``--compile``: decode steps through ``torch.compile``) and ``fp16w`` (``--quant fp16``: fp16 weights in fbgemm's
fp32-compute GEMM, x86 CPUs only) and ``w8a8`` (``--quant w8a8``: int8 weights and activations, fbgemm, x86 CPUs
only; lossy). A row's ``first_decode_s`` is its first decode step in seconds (where a
compiled row compiles). ``--json PATH`` writes the rows:
``engine``, ``prefill_tok_s``, ``decode_tok_s`` (medians over rounds), ``prefill_ratio`` and ``decode_ratio``
(medians of the per-round ratios to llama.cpp), ``weight_MiB``, ``dtype``, ``kv_dtype``, ``rounds``.
``--kv-dtype`` sets the torch rows' KV cache dtype (default auto: fp32 on a CPU), e.g. to compare fp32 and
bf16 attention at a long ``--prompt-tokens``.

``--requantize FTYPE`` runs the model re-quantized by llama.cpp (``Q4_K_M``, ``Q5_K_M``, ``Q6_K`` ...; a temporary
file), both engines on it: the K-quant path's speed without a download.

    python benchmarks/backend_speed.py [-m MODEL.gguf] [--prompt-tokens 512] [--decode-tokens 128] [-t 2]
        [--rounds 3] [--block 16] [--rows int4,fp16w] [--requantize Q4_K_M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(f"Step {i}: we add {i} apples to the basket and count them again." for i in range(400))
    return tokenizer.encode(text, add_bos=False, special=False)[:n]


# row name → (--dtype, --quant, --compile)
ROWS = {"auto": ("auto", "auto", False), "fp32": ("fp32", "none", False), "fp16": ("fp16", "none", False), "bf16": ("bf16", "none", False),
        "int8": ("auto", "int8", False), "int4": ("auto", "int4", False), "int4c": ("auto", "int4", True),
        "fp16w": ("auto", "fp16", False), "w8a8": ("auto", "w8a8", False), "ggml": ("auto", "ggml", False)}


class TorchRow:
    """One torch-backend row, loaded once; :meth:`run` times one round."""

    def __init__(self, source, row: str, n_ctx: int, threads: int, device: str, kv_dtype: str = "auto"):
        from zoomr.backends.torch.engine import TorchBackend

        dtype, quant, compiled = ROWS[row]
        self.be = be = TorchBackend(source, device=device, dtype=dtype, n_ctx=n_ctx, threads=threads, quant=quant,
                                    kv_dtype=kv_dtype, compile=compiled)
        self.info = {"engine": f"torch {row}", "weight_MiB": be.model.weight_bytes() / 2**20,
                     "dtype": str(be.dtype).replace("torch.", ""), "kv_dtype": str(be.kv_dtype).replace("torch.", ""),
                     "weights": be.model.weight_summary()}
        self.seq = None            # the round's sequence (start() frees the last one)
        warm = be.new_sequence()   # warm-up: allocator, prefill and decode kernels (a compiled row compiles here)
        be.prefill(warm, [1] * 16)
        t = time.perf_counter()
        be.decode(warm, 1)
        self.info["first_decode_s"] = time.perf_counter() - t
        for _ in range(4):
            be.decode(warm, 1)
        be.free(warm)

    def start(self, ids: list[int]) -> float:
        """Prefill ``ids`` into a fresh sequence (the last one is freed); seconds."""
        be = self.be
        if self.seq is not None:
            be.free(self.seq)
        self.seq = be.new_sequence()
        t = time.perf_counter()
        logits = be.prefill(self.seq, ids)
        seconds = time.perf_counter() - t
        self.tok = int(np.argmax(logits))
        return seconds

    def step(self, n: int) -> float:
        """Decode ``n`` greedy tokens on the current sequence; seconds."""
        be, seq, tok = self.be, self.seq, self.tok
        t = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(be.decode(seq, tok)))
        self.tok = tok
        return time.perf_counter() - t


class LlamaCppRow:
    """llama-cpp-python on the same file, loaded once; :meth:`run` times one round (KV cleared first)."""

    def __init__(self, path, n_ctx: int, threads: int):
        import llama_cpp

        from zoomr.backends.llamacpp.amx_probe import known_verdict
        from zoomr.backends.llamacpp.runtime import llama_defaults

        self.llama_cpp = llama_cpp
        with llama_defaults(path):  # llama.cpp's AMX layouts fault on some virtual machines: probed, as zoomr loads
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
        self.llm.eval([1] * 16)
        for _ in range(4):
            self.llm.eval([1])
        self.info = {"engine": "llama.cpp", "weight_MiB": os.path.getsize(path) / 2**20}
        if known_verdict() is False:   # the ratios are then against llama.cpp without its AMX kernels: say so
            self.info["weights"] = "AMX layouts off (they fault on this machine)"

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),))

    def start(self, ids: list[int]) -> float:
        """Clear the KV cache and prefill ``ids``; seconds."""
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        seconds = time.perf_counter() - t
        self.tok = int(np.argmax(self._last_logits()))
        return seconds

    def step(self, n: int) -> float:
        """Decode ``n`` greedy tokens; seconds."""
        tok = self.tok
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
        self.tok = tok
        return time.perf_counter() - t


def run_round(engines: list, ids: list[int], n_decode: int, block: int) -> list[tuple[float, float]]:
    """One round: every engine prefills a fresh sequence, then they decode in turns of ``block`` tokens
    until each has decoded ``n_decode``. Returns (prefill tok/s, decode tok/s) per engine."""
    prefill_s = [e.start(ids) for e in engines]
    decode_s = [0.0] * len(engines)
    done = 0
    while done < n_decode:
        n = min(block, n_decode - done)
        for i, e in enumerate(engines):
            decode_s[i] += e.step(n)
        done += n
    return [(len(ids) / p, n_decode / d) for p, d in zip(prefill_s, decode_s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; ratios are the median over them")
    ap.add_argument("--block", type=int, default=16, help="decode tokens an engine runs before the next one takes "
                    "its turn (--block ≥ --decode-tokens: each engine decodes its whole run at once)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"torch rows to run, of {', '.join(ROWS)}")
    ap.add_argument("--kv-dtype", default="auto", help="KV cache / attention dtype of the torch rows (auto: fp32 on a "
                    "CPU, the compute dtype on CUDA)")
    ap.add_argument("--requantize", default=None, metavar="FTYPE",
                    help="run the model re-quantized by llama.cpp to this file type (Q4_K_M, Q5_K_M, Q6_K ...)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()

    from zoomr.backends.models import resolve_model
    from zoomr.backends.tokenizer import LlamaCppTokenizer

    names = a.rows.split(",")
    for row in names:
        if row not in ROWS:
            ap.error(f"--rows: {row!r} unknown (choose from {', '.join(ROWS)})")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.block < 1:
        ap.error("--block must be at least 1")
    src = resolve_model(a.model)
    if a.requantize:
        from zoomr.backends.llamacpp.requantize import requantize_to_temp

        try:
            path, _tmp = requantize_to_temp(src.path, a.requantize)  # _tmp: removed at exit
        except ValueError as e:
            ap.error(f"--requantize: {e}")
        src = resolve_model(str(path))
    ids = prompt_ids(LlamaCppTokenizer(src.path), a.prompt_tokens)
    n_ctx = len(ids) + a.decode_tokens + 8
    engines = [LlamaCppRow(src.path, n_ctx, a.threads)] + [
        TorchRow(src, row, n_ctx, a.threads, a.device, a.kv_dtype) for row in names]
    print(f"{len(ids)}-token prompt, {a.decode_tokens} greedy decode steps in turns of {a.block}, {a.threads} "
          f"threads, {a.rounds} interleaved rounds (medians)", flush=True)
    per_round = [[] for _ in engines]  # [(prefill tok/s, decode tok/s)] per engine
    for r in range(a.rounds):
        for out, res in zip(per_round, run_round(engines, ids, a.decode_tokens, a.block)):
            out.append(res)
        print(f"round {r + 1}: " + ", ".join(f"{e.info['engine']} {d:.1f}" for e, out in zip(engines, per_round)
                                             for _, d in out[-1:]) + " decode tok/s", flush=True)
    print(f"{'engine':<14}{'prefill tok/s':>15}{'×llama.cpp':>12}{'decode tok/s':>14}{'×llama.cpp':>12}"
          f"{'weights MiB':>13}  compute", flush=True)
    rows = []
    for e, out in zip(engines, per_round):
        ref = per_round[0]
        r = {**e.info, "prefill_tok_s": float(np.median([p for p, _ in out])),
             "decode_tok_s": float(np.median([d for _, d in out])),
             "prefill_ratio": float(np.median([p / q for (p, _), (q, _) in zip(out, ref)])),
             "decode_ratio": float(np.median([d / q for (_, d), (_, q) in zip(out, ref)])),
             "rounds": [{"prefill_tok_s": p, "decode_tok_s": d} for p, d in out]}
        rows.append(r)
        print(f"{r['engine']:<14}{r['prefill_tok_s']:>15.1f}{r['prefill_ratio']:>12.2f}{r['decode_tok_s']:>14.1f}"
              f"{r['decode_ratio']:>12.2f}{r['weight_MiB']:>13.0f}  {r.get('dtype', '')} {r.get('weights', '')}"
              f"{' · KV ' + r['kv_dtype'] if 'kv_dtype' in r else ''}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
