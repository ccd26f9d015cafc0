"""ZoomR's block length (``--segment-tokens``) on a model that writes no summaries, against StreamingLLM and H2O
at the same mean active KV: teacher-forced fidelity to full KV, as ``zoomr bench`` measures it.

Not a test: it runs the model for minutes. Per problem (MATH500, the first ``--limit``): full KV generates
``-n`` tokens greedily (``--ignore-eos``, as ``bench -n N --ignore-eos``); then every configuration is
teacher-forced on those tokens (:class:`zoomr.evaluation.batching.FidelityJob`), which gives top-1
agreement, mean KL (nats/token) and the pass's own mean active KV. Each phase (references, ZoomR passes,
baseline passes) decodes ``-np`` sequences per forward, as ``zoomr bench -np`` does. Each ZoomR
configuration's mean active KV sets the budget of StreamingLLM and H2O (:func:`zoomr.evaluation.match.predict_budget`, as ``bench
--match-budget``), so the three are compared at equal memory. Also prints ZoomR §3.5's memory-saving formula
on the measured lengths beside the measured saving (full / mean active tokens over the same pass).

    python benchmarks/segment_sweep.py -n 2048 --limit 3 --segment-tokens 96 --consensus 2,0 [-t 2] [-np 8] [--json out.json]
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
from zoomr.evaluation.batching import FidelityJob, GenerationJob, run_batched  # noqa: E402
from zoomr.evaluation.cells import problem_prompt  # noqa: E402
from zoomr.evaluation.match import predict_budget  # noqa: E402
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec  # noqa: E402


class Pass:
    """One teacher-forced pass of ``spec`` on a problem's full-KV tokens, as a :class:`FidelityJob` on its own
    view of the model; :meth:`row` gives its fidelity with the pass's own KV statistics once it has run."""

    def __init__(self, model, spec: PolicySpec, prompt: list[int], ref):
        self.view = model.with_cache_factory(PolicyCacheFactory(spec))
        self.stats: dict = {}
        free = self.view.free

        def keep_stats(seq):  # the policy's statistics of the pass, read before its sequence is freed
            kv = self.view.kv_stats(seq)
            self.stats.update(kv.extra, saving=round(kv.saving, 3))
            free(seq)

        self.view.free = keep_stats
        self.job = FidelityJob(self.view, prompt, ref)

    def row(self) -> dict:
        """``fidelity_top1``, ``fidelity_kl`` (nats/token), ``fidelity_tokens``, ``fidelity_mean_active_tokens``,
        the policy's name and its end-of-pass statistics (``extra``: saving, §3.5 formula, ...)."""
        return {**self.job.result, "fidelity_mean_active_tokens": round(self.job.mean_active_tokens, 2),
                "policy": self.view.policy_name, "extra": self.stats}


def run_passes(model, passes: list[Pass], n_parallel: int) -> float:
    """Run the passes ``n_parallel`` to a forward (:func:`run_batched`); wall seconds."""
    t0 = time.perf_counter()
    run_batched(model, [p.job for p in passes], n_parallel)
    return time.perf_counter() - t0


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
    ap.add_argument("-np", "--parallel", type=int, default=8, help="passes decoded together in one batched "
                    "forward (as bench -np; the fidelity of a pass does not depend on it)")
    ap.add_argument("--json", default=None, help="write the results here (- for stdout)")
    args = ap.parse_args()
    model = zoomr.load(ctx_size=args.n + 1024, threads=args.threads)
    _, problems = zoomr.load_problems("math500", args.limit)
    problems = problems[args.skip:]
    greedy = SamplingParams(temperature=0.0).validate()
    baselines = args.baselines.split(",")
    # 1. full KV's greedy tokens and logits per problem (the references)
    prompts = {p.id: problem_prompt(model.tokenizer, p, model.n_ctx) for p in problems}
    gens = {p.id: GenerationJob(model, p, prompts[p.id], greedy, args.n, keep_logits=True, ignore_eos=True,
                                hold_reference=True) for p in problems}
    t0 = time.perf_counter()
    run_batched(model, list(gens.values()), args.parallel)
    print(f"full KV: {len(problems)} x {args.n} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    # 2. every ZoomR configuration on every problem
    configs = list(itertools.product([int(x) for x in args.segment_tokens.split(",")],
                                     [int(x) for x in args.consensus.split(",")]))
    zoomr_passes = {}
    for p in problems:
        for seg, c in configs:
            knobs = {"segment_tokens": seg, "consensus": c} | ({"window": args.window} if args.window else {})
            zoomr_passes[p.id, seg, c] = Pass(model, PolicySpec("zoomr", **knobs), prompts[p.id], gens[p.id].reference)
    print(f"zoomr: {len(zoomr_passes)} passes in {run_passes(model, list(zoomr_passes.values()), args.parallel):.0f} s",
          flush=True)
    # 3. each baseline at the budget whose mean active KV matches that ZoomR pass's measured one
    base_passes = {}
    for (pid, seg, c), z in zoomr_passes.items():
        target = z.row()["fidelity_mean_active_tokens"]
        for name in baselines:
            budget, _ = predict_budget(PolicySpec(name), target, len(prompts[pid]), len(gens[pid].reference.tokens))
            base_passes[pid, seg, c, name] = (Pass(model, PolicySpec(name, budget), prompts[pid], gens[pid].reference),
                                              budget)
    wall = run_passes(model, [b for b, _ in base_passes.values()], args.parallel)
    print(f"baselines: {len(base_passes)} passes in {wall:.0f} s", flush=True)
    rows = []
    for (pid, seg, c), z in zoomr_passes.items():
        zr = z.row()
        row = {"problem": pid, "segment_tokens": seg, "consensus": c,
               "full_tokens": len(prompts[pid]) + len(gens[pid].reference.tokens), "zoomr": zr,
               "measured_saving": zr["extra"]["saving"]}
        for name in baselines:
            b, budget = base_passes[pid, seg, c, name]
            row[name] = {**b.row(), "budget": budget}
        rows.append(row)
        line = " · ".join(f"{p} KV {row[p]['fidelity_mean_active_tokens']:.0f} top1 {row[p]['fidelity_top1']:.3f} "
                          f"KL {row[p]['fidelity_kl']:.4f}" for p in ["zoomr", *baselines])
        print(f"{pid} seg {seg} c {c}: {line} · saving {row['measured_saving']}× "
              f"(§3.5 formula {zr['extra'].get('saving_formula')}×)", flush=True)
    summary = {}
    for seg, c in configs:
        mine = [r for r in rows if (r["segment_tokens"], r["consensus"]) == (seg, c)]
        key = f"segment_tokens={seg},consensus={c}"
        summary[key] = {p: {m: round(statistics.fmean(r[p][m] for r in mine), 4)
                            for m in ("fidelity_mean_active_tokens", "fidelity_top1", "fidelity_kl")}
                        for p in ["zoomr", *baselines]}
        # bench's ratio: mean active / mean full KV over the same decode steps (1 / saving)
        summary[key]["active_over_full"] = round(statistics.fmean(1 / r["measured_saving"] for r in mine), 4)
        formula = [r["zoomr"]["extra"].get("saving_formula") for r in mine]
        summary[key]["saving_formula"] = None if None in formula else round(statistics.fmean(formula), 3)
        print(f"{key}: {summary[key]}", flush=True)
    write_json({"n_predict": args.n, "limit": args.limit, "rows": rows, "summary": summary}, args.json)


if __name__ == "__main__":
    main()
