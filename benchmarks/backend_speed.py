"""Prefill and decode throughput of the torch backend (dense, int8, int4, fp16 weights) against llama-cpp-python.

Same model file, same prompt, same thread count, greedy decoding; every engine is timed in this
process one after the other, so the ratios are comparable even though absolute times vary by machine
(and by what else runs on it: one run, not a median).

Rows: ``fp32``, ``fp16``, ``bf16`` (dense weights, ``--quant none``), ``int8`` (``--quant int8``) and ``int4``
(``--quant int4``: a Q4 GGUF's own blocks), the last two at ``--dtype auto``, and ``fp16w`` (``--quant fp16``:
fp16 weights in fbgemm's fp32-compute GEMM, x86 CPUs only). ``--json PATH`` writes the rows:
``engine``, ``prefill_tok_s``, ``decode_tok_s``, ``prefill_ratio`` and ``decode_ratio`` (over llama.cpp's),
``weight_MiB``, ``dtype``, ``kv_dtype``. ``--kv-dtype`` sets the torch rows' KV cache dtype (default auto: fp32
on a CPU), e.g. to compare fp32 and bf16 attention at a long ``--prompt-tokens``.

    python benchmarks/backend_speed.py [-m MODEL.gguf] [--prompt-tokens 512] [--decode-tokens 128] [-t 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = " ".join(f"Step {i}: we add {i} apples to the basket and count them again." for i in range(400))
    return tokenizer.encode(text, add_bos=False, special=False)[:n]


# row name → (--dtype, --quant)
ROWS = {"fp32": ("fp32", "none"), "fp16": ("fp16", "none"), "bf16": ("bf16", "none"), "int8": ("auto", "int8"),
        "int4": ("auto", "int4"), "fp16w": ("auto", "fp16")}


def bench_torch(source, row: str, ids: list[int], n_decode: int, threads: int, device: str,
                kv_dtype: str = "auto") -> dict:
    from zoomr.backends.torch.engine import TorchBackend

    dtype, quant = ROWS[row]
    be = TorchBackend(source, device=device, dtype=dtype, n_ctx=len(ids) + n_decode + 8, threads=threads,
                      quant=quant, kv_dtype=kv_dtype)
    be.prefill(be.new_sequence(), ids[:16])  # warm-up: allocator, kernels
    seq = be.new_sequence()
    t = time.perf_counter()
    logits = be.prefill(seq, ids)
    prefill_s = time.perf_counter() - t
    tok = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(be.decode(seq, tok)))
    decode_s = time.perf_counter() - t
    return {"engine": f"torch {row}", "prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "weight_MiB": be.model.weight_bytes() / 2**20, "dtype": str(be.dtype).replace("torch.", ""),
            "kv_dtype": str(be.kv_dtype).replace("torch.", ""),
            "weights": be.model.weight_summary()}


def bench_llamacpp(path, ids: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + n_decode + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(ids[:16])
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    tok = int(np.argmax(last_logits()))
    t = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
    decode_s = time.perf_counter() - t
    import os
    return {"engine": "llama.cpp", "prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": n_decode / decode_s,
            "weight_MiB": os.path.getsize(path) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"torch rows to run, of {', '.join(ROWS)}")
    ap.add_argument("--kv-dtype", default="auto", help="KV cache / attention dtype of the torch rows (auto: fp32 on a "
                    "CPU, the compute dtype on CUDA)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()

    from zoomr.backends.models import resolve_model
    from zoomr.backends.tokenizer import LlamaCppTokenizer

    for row in a.rows.split(","):
        if row not in ROWS:
            ap.error(f"--rows: {row!r} unknown (choose from {', '.join(ROWS)})")
    src = resolve_model(a.model)
    ids = prompt_ids(LlamaCppTokenizer(src.path), a.prompt_tokens)
    print(f"{len(ids)}-token prompt, {a.decode_tokens} greedy decode steps, {a.threads} threads", flush=True)
    print(f"{'engine':<14}{'prefill tok/s':>15}{'×llama.cpp':>12}{'decode tok/s':>14}{'×llama.cpp':>12}"
          f"{'weights MiB':>13}  compute", flush=True)
    rows = []
    for row in ["llama.cpp"] + a.rows.split(","):  # each row printed as it finishes
        r = (bench_llamacpp(src.path, ids, a.decode_tokens, a.threads) if row == "llama.cpp"
             else bench_torch(src, row, ids, a.decode_tokens, a.threads, a.device, a.kv_dtype))
        rows.append(r)
        r["decode_ratio"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
        r["prefill_ratio"] = r["prefill_tok_s"] / rows[0]["prefill_tok_s"]
        print(f"{r['engine']:<14}{r['prefill_tok_s']:>15.1f}{r['prefill_ratio']:>12.2f}{r['decode_tok_s']:>14.1f}"
              f"{r['decode_ratio']:>12.2f}{r['weight_MiB']:>13.0f}  {r.get('dtype', '')} {r.get('weights', '')}"
              f"{' · KV ' + r['kv_dtype'] if 'kv_dtype' in r else ''}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
