"""KV-Rescue per committed step: batched candidates vs one after another, same seed, one process, one run.

The base is the embedded model under R-KV (budget ``--budget``), the helper the same model with full KV,
the scorer the helper-likelihood fallback. Both modes run the same question with the same seed and
settings (``RescueConfig(batched=...)``), in the order given by ``--order`` (default sequential first);
the committed steps are compared (they should be identical, see :mod:`zoomr.rescue.loop`). Reported per
mode: wall seconds, committed steps, seconds per committed step, candidate tokens sampled and candidate
tok/s; then the sequential/batched ratio of seconds per step. Per step (``kv_steps``): the peak of the
distinct K/V bytes alive (committed states + forks, shared blocks counted once, allocated capacity), the
committed states' bytes at the step's start, and ``peak_over_need`` = peak / (committed + the candidates'
own new tokens × bytes per position); the issue's target is ≤ 1.10.

The issue's target: N_b = N_h = 4, 5 steps of ≤ 64 tokens, batched ≥ 2.5× faster per committed step.
On a shared machine the absolute numbers move with the load (the load average is recorded).

    python benchmarks/rescue_batch.py [-t 2] [--nb 4] [--nh 4] [--steps 5] [--step-tokens 64] [--seed 0]
        [--budget 64] [--dtype fp32] [--order sequential batched] [--json out.json|-]
"""

from __future__ import annotations

import json
import os
import sys
import time

from _report import engine_parser, write_json  # benchmarks/ is on sys.path when a script runs

QUESTION = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
            "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
            "egg. How much in dollars does she make every day at the farmers' market?")


class KVProbe:
    """Distinct K/V bytes held by everything alive (both committed states + every candidate fork), sampled
    after each forward; per step, the peak against what the step must hold at least: the committed states
    at the step's start plus each candidate's own new tokens (tokens × K/V bytes per position).

    Instrumentation only: it wraps the two backend views' ``fork``/``scoring_fork``/``free``/``forward_batch``/
    ``prefill``/``decode`` on the instances (every call goes through unchanged) and listens to the run's events.
    """

    def __init__(self, engines, token_bytes: int):
        from zoomr.kvstore.stats import distinct_kv_bytes

        self._distinct, self.engines, self.token_bytes = distinct_kv_bytes, engines, token_bytes
        self.live: dict[int, object] = {}
        self.peak = self.committed = 0
        self.tokens: dict[int, int] = {}
        self.rows: list[dict] = []
        for be in {id(e.backend): e.backend for e in engines}.values():
            self._wrap(be)

    def _wrap(self, be) -> None:
        free = be.free

        def tracked(fork):
            def tracked_fork(seq):
                child = fork(seq)
                self.live[id(child)] = child
                return child
            return tracked_fork

        def tracked_free(seq):
            self.live.pop(id(seq), None)
            free(seq)

        be.fork, be.scoring_fork, be.free = tracked(be.fork), tracked(be.scoring_fork), tracked_free
        for name in ("forward_batch", "prefill", "decode"):
            setattr(be, name, self._sampled(getattr(be, name)))

    def _sampled(self, fn):
        def call(*a, **k):
            out = fn(*a, **k)
            self.peak = max(self.peak, self._held(list(self.live.values())))
            return out
        return call

    def _held(self, extra) -> int:
        caches = [s.cache for s in [e.seq for e in self.engines] + extra if s is not None]
        return sum(self._distinct(caches).values())

    def __call__(self, event) -> None:
        kind = event.kind
        if kind == "candidate_started" and not self.tokens:
            self.committed = self._held([])
            self.peak = self._held(list(self.live.values()))
        elif kind in ("token", "candidate_finished", "candidate_aborted"):
            self.tokens[event.cand] = max(self.tokens.get(event.cand, 0), getattr(event, "n", 0),
                                          getattr(event, "tokens", 0))
        elif kind == "step_committed":
            need = self.committed + sum(self.tokens.values()) * self.token_bytes
            self.rows.append({"step": event.step, "committed_bytes": self.committed, "peak_bytes": self.peak,
                              "candidate_tokens": sum(self.tokens.values()), "need_bytes": need,
                              "peak_over_need": round(self.peak / need, 3)})
            self.tokens = {}


def run_mode(base, helper, batched: bool, args) -> dict:
    from zoomr.backends.sampling import Sampler, SamplingParams
    from zoomr.prompts import solve_prompt
    from zoomr.rescue.engine import Engine
    from zoomr.kvstore.events import EventBus
    from zoomr.rescue.loop import RescueConfig, RescueLoop
    from zoomr.rescue.scorers import HelperLikelihoodScorer
    from zoomr.rescue.transcript import Transcript

    import copy

    events, tr = EventBus(), Transcript()
    events.subscribe(tr)
    config = RescueConfig(args.nb, args.nh, args.step_tokens, args.steps, 4096, batched=batched)
    # fresh views of the two backends (weights shared): the probe wraps their methods for this run only
    engines = [Engine("base", copy.copy(base)), Engine("helper", copy.copy(helper))]
    c = helper.cfg
    probe = KVProbe(engines, 2 * c.n_layers * c.n_kv_heads * c.head_dim * helper.kv_dtype.itemsize)
    events.subscribe(probe)
    loop = RescueLoop(*engines, HelperLikelihoodScorer(), Sampler(SamplingParams(0.8, 20, 0.95, args.seed)), config,
                      events)
    ids = solve_prompt(base.tokenizer, QUESTION)
    t0 = time.perf_counter()
    try:
        reason = loop.run(QUESTION, ids, ids)
    finally:
        loop.close()
    wall = time.perf_counter() - t0
    s = tr.summary()
    steps = len(s["steps"])
    cand_tokens = s["base_tokens"] + s["helper_tokens"]
    return {"mode": "batched" if batched else "sequential", "seconds": round(wall, 3), "steps": steps,
            "s_per_step": round(wall / max(steps, 1), 3), "candidate_tokens": cand_tokens,
            "candidate_tok_s": round(cand_tokens / wall, 2), "aborted": s["aborted"], "stop_reason": reason,
            "committed": [st["text"] for st in s["steps"]], "kv_steps": probe.rows,
            "max_peak_over_need": max((r["peak_over_need"] for r in probe.rows), default=None)}


def main() -> None:
    ap = engine_parser(__doc__.split("\n")[0])
    ap.add_argument("--nb", type=int, default=4)
    ap.add_argument("--nh", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="most committed steps")
    ap.add_argument("--step-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=64, help="the base's R-KV budget (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", nargs="+", default=["sequential", "batched"], choices=["sequential", "batched"])
    ap.add_argument("--json", default=None, help="write the record here ('-': stdout)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

    source = resolve_model(args.model)
    helper = TorchBackend(source, device=args.device, dtype=args.dtype, n_ctx=4096, threads=args.threads,
                        quant=args.quant)
    base = helper.with_cache_factory(PolicyCacheFactory(PolicySpec("rkv", args.budget)))
    load0 = os.getloadavg()
    rows = []
    for mode in args.order:
        rows.append(run_mode(base, helper, mode == "batched", args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "committed"}), file=sys.stderr, flush=True)
    by = {r["mode"]: r for r in rows}
    record = {"model": source.name, "dtype": args.dtype, "quant": args.quant, "threads": args.threads, "cpus": os.cpu_count(),
              "nb": args.nb, "nh": args.nh, "max_steps": args.steps, "step_tokens": args.step_tokens,
              "budget": args.budget, "seed": args.seed, "load_avg_start": load0, "load_avg_end": os.getloadavg(),
              "rows": rows}
    if len(by) == 2:
        record["speedup_per_step"] = round(by["sequential"]["s_per_step"] / by["batched"]["s_per_step"], 3)
        record["same_commits"] = by["sequential"]["committed"] == by["batched"]["committed"]
    print(f"{'mode':10} {'steps':>5} {'s/step':>8} {'cand tok':>8} {'tok/s':>7} {'peak KV/need':>12}", file=sys.stderr)
    for r in rows:
        print(f"{r['mode']:10} {r['steps']:>5} {r['s_per_step']:8.2f} {r['candidate_tokens']:>8} "
              f"{r['candidate_tok_s']:7.1f} {r['max_peak_over_need']:>12}", file=sys.stderr)
    if "speedup_per_step" in record:
        print(f"batched speed-up per committed step: {record['speedup_per_step']}× "
              f"(same commits: {record['same_commits']})", file=sys.stderr)
    write_json(record, args.json)


if __name__ == "__main__":
    main()
