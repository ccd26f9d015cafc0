"""Does a `zoomr finetune` model write its own summaries, and does ZoomR gain from them? (issue 15)

Runs ``zoomr bench`` twice on the first K GSM8K test problems (the packaged set, as ``zoomr bench --dataset
gsm8k`` loads it), greedy, ``--policies full,zoomr`` with teacher-forced fidelity:

- the fine-tuned directory with ``--summaries model`` (segments only from the summaries it writes);
- the base model with ``--summaries auto`` (bounded blocks, since it writes none).

Then reads the two ``records.jsonl`` and reports:

- free generation (the full-KV texts): paragraphs, the share followed by a well-formed summary
  (``<|begin_of_summary|>`` + non-empty text without a nested delimiter + ``<|end_of_summary|>``), mean
  summary and paragraph lengths (tokens of the fine-tuned tokenizer). A "paragraph" is the text between
  summaries (and the text after the last one, when not blank), so a model that never summarizes has one
  paragraph per problem; ``blank_line_paragraphs`` splits that text further at blank lines, a stricter view;
- accuracy with full KV, fine-tuned vs base;
- ZoomR on each: accuracy, mean active KV (tokens) and its share of full KV, top-1 agreement and KL (nats)
  to full KV, recomputes, AG mean ± std (``ag_mean``/``ag_std`` of zoomr's kv_extra), summary mode that ran.

Numbers depend on the machine's load (recorded). A stopped run keeps its records (bench appends per
cell): ``--resume`` continues it, ``--report-only`` summarizes what is there.

    python benchmarks/finetune_demo.py FINETUNED_DIR [-m BASE] [-k 50] [-np 8] [-n 256] [-t 2] [--dtype fp32]
        [--window 128] [--out demo_out] [--resume] [--report-only] [--json out.json|-]

The untied demo (issue 28) runs it on a fine-tune of ``benchmarks/untie_model.py``'s untied copy of the
embedded model, with that copy as ``-m BASE`` (docs/finetune.md "Measured: an untied head" has the commands).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import write_json  # benchmarks/ is on sys.path when a script runs

from zoomr.evaluation.records import RecordLog
from zoomr.kvstore.segments import BEGIN, END
_MARKUP = re.compile(r"<\|[a-z_]+\|>")  # control tokens such as <|im_end|>, left in decoded text


def split_summaries(text: str) -> tuple[list[tuple[str, str | None]], int]:
    """([(paragraph, its well-formed summary or None)], malformed summaries) of one generated text.

    Each paragraph is the text before a ``BEGIN`` (since the previous summary), plus the text after the
    last summary when it holds more than white space and control-token markup (an end-of-turn token); a
    summary is well formed when its ``END`` comes before any other ``BEGIN`` and its content is not blank.
    An unclosed or nested ``BEGIN`` counts as malformed and ends the parse.
    """
    pairs: list[tuple[str, str | None]] = []
    bad, at = 0, 0
    while True:
        b = text.find(BEGIN, at)
        if b < 0:
            if _MARKUP.sub("", text[at:]).strip():
                pairs.append((text[at:], None))
            return pairs, bad
        e = text.find(END, b + len(BEGIN))
        nxt = text.find(BEGIN, b + len(BEGIN))
        if e < 0 or (0 <= nxt < e):
            return pairs + [(text[at:b], None)], bad + 1
        body = text[b + len(BEGIN):e]
        pairs.append((text[at:b], body if body.strip() else None))
        bad += not body.strip()
        at = e + len(END)


def free_generation(records: list[dict], count) -> dict:
    """Summary statistics of the texts of ``records`` (see the module docstring); ``count`` = text → tokens."""
    paras = sums = bad = with_summary = blank_paras = blank_followed = 0
    p_len, s_len = [], []
    for r in records:
        pairs, b = split_summaries(r["text"])
        ss = [s for _, s in pairs if s is not None]
        paras += len(pairs)
        sums += len(ss)
        bad += b
        with_summary += bool(ss)
        p_len += [count(p) for p, _ in pairs]
        s_len += [count(s) for s in ss]
        for p, s in pairs:
            pieces = [x for x in p.split("\n\n") if x.strip()] or [p]
            blank_paras += len(pieces)
            blank_followed += s is not None  # the last piece before a well-formed summary
    mean = lambda xs: round(statistics.fmean(xs), 2) if xs else None  # noqa: E731
    return {"problems": len(records), "paragraphs": paras, "summaries": sums, "malformed": bad,
            "share_followed_by_summary": round(sums / paras, 4) if paras else None,
            "problems_with_a_summary": with_summary,
            "blank_line_paragraphs": blank_paras,
            "share_blank_line_paragraphs_followed": round(blank_followed / blank_paras, 4) if blank_paras else None,
            "mean_summary_tokens": mean(s_len), "mean_paragraph_tokens": mean(p_len),
            "summary_over_paragraph": round(mean(s_len) / mean(p_len), 4) if s_len and p_len else None,
            "mean_generated_tokens": mean([r["tokens_generated"] for r in records])}


def zoomr_cells(records: list[dict]) -> dict:
    """Accuracy, KV and fidelity of the zoomr records, means over problems (AG: mean of the per-problem
    means, ± the mean of the per-problem std; problems without groups are left out of AG)."""
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    x = [r.get("kv_extra") or {} for r in records]
    ag = [e["ag_mean"] for e in x if e.get("ag_mean") is not None]
    ag_std = [e["ag_std"] for e in x if e.get("ag_std") is not None]
    modes: dict[str, int] = {}
    for e in x:
        modes[str(e.get("summaries_mode"))] = modes.get(str(e.get("summaries_mode")), 0) + 1
    return {"problems": len(records), "accuracy": mean([float(r["correct"]) for r in records]),
            "mean_active_tokens": mean([r["mean_active_tokens"] for r in records]),
            "active_over_full": mean([r["mean_active_tokens"] / max(1, r["full_tokens"]) for r in records]),
            "fidelity_top1": mean([r["fidelity_top1"] for r in records if r.get("fidelity_top1") is not None]),
            "fidelity_kl": mean([r["fidelity_kl"] for r in records if r.get("fidelity_kl") is not None]),
            "recomputes": mean([e.get("recomputes", 0) for e in x]),
            "segments": mean([e.get("segments", 0) for e in x]),
            "ag_mean": mean(ag), "ag_std": mean(ag_std), "ag_problems": len(ag),
            "ag_mean_std_over_problems": round(statistics.pstdev(ag), 4) if len(ag) > 1 else None,
            "summaries_mode": modes, "mean_generated_tokens": mean([r["tokens_generated"] for r in records])}


def run_bench(model: str | None, summaries: str, out: Path, args) -> float:
    """``zoomr bench`` (this interpreter's zoomr) on the first K GSM8K problems; returns its wall seconds."""
    cmd = [sys.executable, "-m", "zoomr", "bench", "--dataset", "gsm8k", "--limit", str(args.k),
           "--policies", "full,zoomr", "--summaries", summaries, "--window", str(args.window),
           "-np", str(args.np), "-n", str(args.n_predict),
           "-t", str(args.threads), "--dtype", args.dtype, "--no-live", "--out", str(out)] + (["-m", model] if model else []) + \
          (["--resume"] if args.resume else [])
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return round(time.monotonic() - t0, 1)


def read_records(out: Path) -> dict[str, list[dict]]:
    """{policy: records, in problem order} of a bench folder."""
    by: dict[str, list[dict]] = {}
    f = out / "records.jsonl"
    for r in RecordLog(f).records if f.is_file() else []:  # bench's own reader: checked lines, torn tail dropped
        by.setdefault(r["policy"], []).append(r)
    return by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("finetuned", help="directory written by zoomr finetune")
    ap.add_argument("-m", "--model", default=None, help="base model (default: the embedded model)")
    ap.add_argument("-k", type=int, default=50, help="first K GSM8K test problems (default 50)")
    ap.add_argument("-np", type=int, default=8, help="sequences decoded together (zoomr bench -np)")
    ap.add_argument("-n", "--n-predict", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=2)
    # 128, not bench's 512: generations of -n 256 never fill a 512-token window, so ZoomR would select
    # everything and its KV columns would only repeat full KV's
    ap.add_argument("--window", type=int, default=128, help="ZoomR's recent window (tokens; zoomr bench --window)")
    ap.add_argument("--dtype", default="fp32", help="torch dtype of both models (fp16 matmuls are slow on a CPU)")
    ap.add_argument("--out", default="finetune_demo_out", help="folder for the two bench runs")
    ap.add_argument("--resume", action="store_true", help="continue the bench runs in --out")
    ap.add_argument("--report-only", action="store_true", help="only summarize the records already in --out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.k < 1 or args.np < 1:
        sys.exit("finetune_demo: -k and -np must be >= 1")
    ft_dir = Path(args.finetuned)
    if not (ft_dir / "config.json").is_file():
        sys.exit(f"finetune_demo: {ft_dir}: not a zoomr finetune export (no config.json)")
    from zoomr.backends.tokenizer import HFTokenizer

    tok = HFTokenizer(ft_dir)
    count = lambda s: len(tok.encode(s, special=False))  # noqa: E731
    out = Path(args.out)
    runs = {"finetuned": (str(ft_dir), "model"), "base": (args.model, "auto")}
    seconds = {}
    if not args.report_only:
        for name, (model, summaries) in runs.items():
            seconds[name] = run_bench(model, summaries, out / name, args)
    recs = {name: read_records(out / name) for name in runs}
    # a stopped run: compare on the problems that have every cell in both runs (and within the first K)
    from zoomr.evaluation.datasets import load_problems

    first = {p.id for p in load_problems("gsm8k", args.k)[1]}
    ids = set.intersection(first, *({r["problem_id"] for r in recs[n].get(p, [])} for n in runs for p in ("full", "zoomr")))
    recs = {n: {p: [r for r in rs if r["problem_id"] in ids] for p, rs in by.items()} for n, by in recs.items()}
    report = {
        "finetuned": str(ft_dir), "base": args.model or "embedded", "k": args.k, "problems_compared": len(ids), "n_predict": args.n_predict,
        "np": args.np, "threads": args.threads, "dtype": args.dtype, "load_avg": os.getloadavg(), "bench_seconds": seconds,
        "free_generation": {name: free_generation(recs[name].get("full", []), count) for name in runs},
        "accuracy_full_kv": {name: zoomr_cells(recs[name].get("full", []))["accuracy"] for name in runs},
        "zoomr": {"finetuned_summaries_model": zoomr_cells(recs["finetuned"].get("zoomr", [])),
                  "base_summaries_auto": zoomr_cells(recs["base"].get("zoomr", []))},
    }
    for name in runs:
        report["free_generation"][name]["example"] = (recs[name].get("full") or [{"text": ""}])[0]["text"][:600]
    print(json.dumps({k: v for k, v in report.items()}, indent=1) if args.json is None else "", end="")
    write_json(report, args.json)


if __name__ == "__main__":
    main()
