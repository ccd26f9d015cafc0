"""ZoomR's block length (``--segment-tokens``) on a model that writes no summaries, against StreamingLLM and H2O
at the same mean active KV: teacher-forced fidelity to full KV, as ``zoomr bench`` measures it.

Not a test: it runs the model for minutes. Per problem (MATH500, the first ``--limit``): full KV generates
``-n`` tokens greedily (``--ignore-eos``, as ``bench -n N --ignore-eos``); then every configuration is
teacher-forced on those tokens (:func:`zoomr.evaluation.batching.teacher_forced_fidelity`), which gives top-1
agreement, mean KL (nats/token) and the pass's own mean active KV. Each ZoomR configuration's mean active KV
sets the budget of StreamingLLM and H2O (:func:`zoomr.evaluation.match.predict_budget`, as ``bench
--match-budget``), so the three are compared at equal memory. Also prints ZoomR §3.5's memory-saving formula
on the measured lengths beside the measured saving (full / mean active tokens over the same pass).

    python benchmarks/segment_sweep.py -n 2048 --limit 3 --segment-tokens 96 --consensus 2,0 [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

import zoomr  # noqa: E402
from zoomr.backends.sampling import SamplingParams  # noqa: E402
from zoomr.evaluation.batching import GenerationJob, run_batched, teacher_forced_fidelity  # noqa: E402
from zoomr.evaluation.cells import problem_prompt  # noqa: E402
from zoomr.evaluation.match import predict_budget  # noqa: E402
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec  # noqa: E402


def fidelity(model, spec: PolicySpec, prompt: list[int], ref) -> dict:
    """Teacher-forced fidelity of ``spec`` on full KV's tokens, with the pass's own KV stats."""
    view = model.with_cache_factory(PolicyCacheFactory(spec))
    stats = {}
    free = view.free

    def keep_stats(seq):  # the policy's statistics of the pass, read before its sequence is freed
        kv = view.kv_stats(seq)
        stats.update(kv.extra, saving=round(kv.saving, 3))
        free(seq)

    view.free = keep_stats
    t0 = time.perf_counter()
    out = teacher_forced_fidelity(view, prompt, ref)
    return {**out, "policy": view.policy_name, "wall_s": round(time.perf_counter() - t0, 1), "extra": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1024, help="tokens full KV generates per problem")
    ap.add_argument("--limit", type=int, default=3, help="MATH500 problems")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N of them (to add problems to a run)")
    ap.add_argument("--segment-tokens", default="48,96,192", help="comma-separated --segment-tokens values")
    ap.add_argument("--baselines", default="streaming,h2o", help="policies matched to each ZoomR run")
    ap.add_argument("--window", type=int, default=None, help="ZoomR --window (default: its own)")
    ap.add_argument("--consensus", default="2", help="comma-separated ZoomR --consensus values (0: the "
                    "ablation that zooms nothing, to see what the retrieval adds over prompt + window)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="CPU threads (1: steadier on a shared machine)")
    ap.add_argument("--json", default=None, help="write the results here (- for stdout)")
    args = ap.parse_args()
    model = zoomr.load(ctx_size=args.n + 1024, threads=args.threads)
    _, problems = zoomr.load_problems("math500", args.limit)
    problems = problems[args.skip:]
    greedy = SamplingParams(temperature=0.0).validate()
    rows = []
    for problem in problems:
        prompt = problem_prompt(model.tokenizer, problem, model.n_ctx)
        t0 = time.perf_counter()
        gen = GenerationJob(model, problem, prompt, greedy, args.n, keep_logits=True, ignore_eos=True,
                            hold_reference=True)
        run_batched(model, [gen], 1)
        ref = gen.reference
        print(f"{problem.id}: full KV {len(ref.tokens)} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        full_tokens = len(prompt) + len(ref.tokens)
        for seg, c in itertools.product([int(x) for x in args.segment_tokens.split(",")],
                                        [int(x) for x in args.consensus.split(",")]):
            knobs = {"segment_tokens": seg, "consensus": c} | ({"window": args.window} if args.window else {})
            z = fidelity(model, PolicySpec("zoomr", **knobs), prompt, ref)
            target = z["fidelity_mean_active_tokens"]
            row = {"problem": problem.id, "segment_tokens": seg, "consensus": c, "full_tokens": full_tokens,
                   "zoomr": z, "measured_saving": z["extra"]["saving"]}
            for name in args.baselines.split(","):
                budget, _ = predict_budget(PolicySpec(name), target, len(prompt), len(ref.tokens))
                row[name] = {**fidelity(model, PolicySpec(name, budget), prompt, ref), "budget": budget}
            rows.append(row)
            line = " · ".join(f"{p} ({row[p]['wall_s']:.0f} s) KV {row[p]['fidelity_mean_active_tokens']:.0f} top1 {row[p]['fidelity_top1']:.3f} "
                              f"KL {row[p]['fidelity_kl']:.4f}" for p in ["zoomr", *args.baselines.split(",")])
            print(f"{problem.id} seg {seg} c {c}: {line} · saving {row['measured_saving']}× "
                  f"(§3.5 formula {z['extra'].get('saving_formula')}×)", flush=True)
    summary = {}
    for seg, c in sorted({(r["segment_tokens"], r["consensus"]) for r in rows}):
        mine = [r for r in rows if (r["segment_tokens"], r["consensus"]) == (seg, c)]
        key = f"segment_tokens={seg},consensus={c}"
        summary[key] = {p: {m: round(statistics.fmean(r[p][m] for r in mine), 4)
                            for m in ("fidelity_mean_active_tokens", "fidelity_top1", "fidelity_kl")}
                        for p in ["zoomr", *args.baselines.split(",")]}
        # bench's ratio: mean active / mean full KV over the same decode steps (1 / saving)
        summary[key]["active_over_full"] = round(statistics.fmean(1 / r["measured_saving"] for r in mine), 4)
        summary[key]["saving_formula"] = round(statistics.fmean(r["zoomr"]["extra"].get("saving_formula", 0) for r in mine), 3)
        print(f"{key}: {summary[key]}", flush=True)
    write_json({"n_predict": args.n, "limit": args.limit, "rows": rows, "summary": summary}, args.json)


if __name__ == "__main__":
    main()
