"""How closely the torch backend's weight formats follow llama.cpp, and whether ZoomR selects the same under them.

Two measurements, teacher-forced over the same real text (GSM8K questions and worked answers from the copy
shipped in the package, as the parity test reads them), one run:

1. Logits: for each ``--rows`` entry (``dtype:quant``, as ``--dtype`` / ``--quant``; ``dtype:quant:compile``
   adds ``--compile``), top-1 agreement with
   llama.cpp on the same GGUF file and mean KL(llama.cpp || torch) in nats over ``--tokens`` positions,
   once through prefill (one forward, every position's logits) and once through decode (one token a
   forward, what generation runs). The issue's target for the quantized path: top-1 ≥ 0.98, KL ≤ 0.003.
2. ZoomR (``--summaries auto``): the same text decoded token by token under ``--policy zoomr`` with the
   reference row (``fp32:none``) and each other row; every recompute's zoomed-in and summary segment
   lists compared position by position. The issue's target: the same selections for ≥ 95% of recomputes.

3. Bytes (``bytes`` in the JSON): per GGUF type of the file's quantized tensors, the bytes the file holds them
   in, the bytes ``--quant auto`` (bf16) holds them in as linears, their ratio, and the form (``int4 (Q4_K)``,
   ``int4×2 (Q6_K regrouped)``, ...).

``--requantize FTYPE`` first has llama.cpp re-quantize the model (``Q4_K_M``, ``Q5_K_M``, ``Q6_K`` ...; written to
a temporary directory) and measures that file: K-quant files without a download.

    python benchmarks/quant_fidelity.py [--rows fp32:none,bf16:auto,bf16:auto:compile,fp32:fp16] [--tokens 512]
        [--zoomr-problems 3] [--zoomr-tokens 384] [-t 2] [--requantize Q4_K_M] [--json out.json|-]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from _report import write_json  # benchmarks/ is on sys.path when a script runs


def logits_both_ways(be, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """([T, vocab] from one prefill, [T, vocab] from one decode a token) on fresh sequences."""
    pre = np.asarray(be.prefill(be.new_sequence(), ids, all_logits=True))
    seq = be.new_sequence()
    rows = [np.asarray(be.prefill(seq, ids[:1]))]
    rows += [np.asarray(be.decode(seq, t)) for t in ids[1:]]
    return pre, np.stack(rows)


def zoomr_selections(be, problems: list[tuple[list[int], list[int]]]) -> list[list[tuple]]:
    """Per problem, every ZoomR recompute as (position, zoomed, summaries), teacher-forced on its answer.

    Args:
        be: a loaded torch backend running ``--policy zoomr``.
        problems: (prompt ids, answer ids) pairs.
    """
    from zoomr.kvstore.events import kv_events

    out: list[list[tuple]] = []
    kv_events(be).subscribe(lambda e: out[-1].append((e.position, tuple(e.zoomed), tuple(e.summaries))))
    for prompt, answer in problems:
        out.append([])
        seq = be.new_sequence()
        be.prefill(seq, prompt)
        for t in answer:
            be.decode(seq, t)
        be.free(seq)
    return out


def bytes_by_type(path) -> dict[str, dict]:
    """Per GGUF type of ``path``'s kept quantized tensors: file bytes, bytes held as a ``--quant auto`` bf16
    linear (each tensor alone), their ratio and the form it runs in."""
    import gguf
    import torch

    from zoomr.backends.torch.quant import GroupQuant, make_linear
    from zoomr.backends.torch.weights import load_gguf

    _, kept, _ = load_gguf(path, keep_blocks=True)
    out: dict[str, dict] = {}
    for q in kept.values():
        if not isinstance(q, GroupQuant):
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q.source]]
        lin = make_linear([q], None, "auto", torch.device("cpu"), torch.bfloat16)
        row = out.setdefault(q.source, {"form": lin.kind, "tensors": 0, "file_bytes": 0, "held_bytes": 0})
        row["tensors"] += 1
        row["file_bytes"] += q.shape[0] * q.shape[1] // block * size
        row["held_bytes"] += lin.nbytes()
    for row in out.values():
        row["ratio"] = round(row["held_bytes"] / row["file_bytes"], 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--rows", default="fp32:none,bf16:auto,fp32:fp16",
                    help="dtype:quant pairs; the first is the ZoomR reference")
    ap.add_argument("--tokens", type=int, default=512, help="teacher-forced positions for the logits")
    ap.add_argument("--zoomr-problems", type=int, default=3, help="GSM8K problems for the ZoomR comparison (0: skip)")
    ap.add_argument("--zoomr-tokens", type=int, default=384, help="answer tokens forced per problem")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--requantize", default=None, metavar="FTYPE",
                    help="measure the model re-quantized by llama.cpp to this file type (Q4_K_M, Q5_K_M, Q6_K ...)")
    ap.add_argument("--json", default=None, help="write the record here ('-': stdout)")
    a = ap.parse_args()
    if a.requantize:
        from zoomr.backends.llamacpp.requantize import requantize_to_temp
        from zoomr.backends.models import resolve_model as _resolve

        try:
            path, _tmp = requantize_to_temp(_resolve(a.model).path, a.requantize)  # _tmp: removed at exit
        except ValueError as e:
            ap.error(f"--requantize: {e}")
        a.model = str(path)

    import zoomr
    from zoomr.backends.models import resolve_model
    from zoomr.backends.tokenizer import LlamaCppTokenizer
    from zoomr.evaluation.datasets import records
    from zoomr.evaluation.parity import agreement, gsm8k_text_ids, llamacpp_logits
    from zoomr.factory import with_policy
    from zoomr.options import RunOptions

    rows = [tuple(r.split(":")) for r in a.rows.split(",")]
    if any(len(r) not in (2, 3) or r[2:] not in ((), ("compile",)) for r in rows):
        ap.error("--rows: dtype:quant pairs, e.g. bf16:auto, or dtype:quant:compile (--compile)")
    src = resolve_model(a.model)
    tok = LlamaCppTokenizer(src.path)
    ids = gsm8k_text_ids(tok, a.tokens)
    ref = llamacpp_logits(src.path, ids)
    log = sys.stderr if a.json == "-" else sys.stdout
    record = {"tokens": len(ids), "file_type": a.requantize, "bytes": bytes_by_type(src.path), "rows": []}
    for t, row in record["bytes"].items():
        print(f"{t:<5} {row['tensors']:>4} tensors: {row['held_bytes'] / 2**20:7.2f} MiB held / "
              f"{row['file_bytes'] / 2**20:7.2f} MiB in the file = {row['ratio']:.3f}×  [{row['form']}]", file=log)
    problems = []
    for i, rec in enumerate(records("gsm8k")):
        if i >= a.zoomr_problems:
            break
        prompt = tok.encode(f"Question: {rec['question']}\nAnswer:", add_bos=False, special=False)
        # the answer repeated: long enough for --zoomr-tokens, real text with sentence and line boundaries
        answer = tok.encode(" " + (rec["answer"] + "\n\n") * 8, add_bos=False, special=False)[:a.zoomr_tokens]
        problems.append((prompt, answer))
    reference_sel = None
    for dtype, quant, *compiled in rows:
        be = zoomr.load(a.model, dtype=dtype, quant=quant, threads=a.threads, ctx_size=max(len(ids) + 8, 4096),
                        device="cpu", compile=bool(compiled))
        pre, dec = logits_both_ways(be, ids)
        row = {"dtype": dtype, "quant": quant, "compile": bool(compiled), "model": be.describe_model(),
               **{way: dict(zip(("top1", "kl"), (round(x, 5) for x in agreement(got, ref))))
                  for way, got in (("prefill", pre), ("decode", dec))}}
        zoomr_line = ""
        if problems:   # the same weights under ZoomR (a view: nothing reloaded)
            sel = zoomr_selections(with_policy(be, RunOptions(policy="zoomr", ctx_size=be.n_ctx)), problems)
            n = sum(len(s) for s in sel)
            if reference_sel is None:
                reference_sel = sel
                row["zoomr"] = {"recomputes": n}
                zoomr_line = f" · zoomr {n} recomputes (reference)"
            else:
                same = sum(x == y for s, r in zip(sel, reference_sel) for x, y in zip(s, r))
                total = max(n, sum(len(r) for r in reference_sel), 1)
                row["zoomr"] = {"recomputes": n, "same_as_reference": same, "share": round(same / total, 4)}
                zoomr_line = f" · zoomr {same}/{total} recomputes as the reference"
        record["rows"].append(row)
        print(f"{dtype}:{quant}{':compile' if compiled else '':<8} prefill top-1 {row['prefill']['top1']:.4f} KL {row['prefill']['kl']:.5f} · decode "
              f"top-1 {row['decode']['top1']:.4f} KL {row['decode']['kl']:.5f}{zoomr_line}  [{row['model']}]",
              file=log, flush=True)
    if a.json:
        write_json(record, a.json)


if __name__ == "__main__":
    main()
