"""Calibration of the KV-Rescue degeneration detector: false aborts on real solution steps, detection of loops.

Not a test: it measures how often :class:`zoomr.rescue.degeneration.DegenerationDetector` aborts text that
it should keep, and how often it catches text that it should abort, with three gzip thresholds side by side:

* ``before``: the constant τ_cmp = 0.18 at every fill of the 800-character window (zoomr up to issue 12: a
  short text was judged on its whole length as if it were a full window);
* ``scaled``: :meth:`DetectorConfig.gzip_threshold`, τ_cmp · n / 800 for a window of n < 800 characters,
  gzip alone; since issue 29 a text that ends in a sentence repeated verbatim (a unit holding a word, not
  cells, numbers or LaTeX commands: :func:`zoomr.rescue.degeneration.prose_unit`) is judged by τ_cmp itself;
* ``after``: what ships: ``scaled`` plus the periodic-tail ``"cycle"`` test (digits masked; 256 characters
  of repeat once the window is full, or 64 copies of one unit, 32 if they cover 256 characters; since
  issue 29 read over the committed steps before the candidate too, and a fourth copy of a unit holding the
  step end after three committed ones);
* ``full_window``: no gzip abort at all before 800 characters (the alternative considered and rejected:
  a loop of one-character tokens never fills the window within a 512-token step).

Text is fed the way :class:`zoomr.rescue.loop.RescueLoop` feeds a base candidate: tokenized by the embedded
model's tokenizer, one ``observe`` per token with the text the token completes (``StreamDecoder``), cut at
the step limit (512 tokens). Sets:

1. Real steps: GSM8K worked answers split at newlines, MATH500 solutions split at blank lines (the loop's
   step end), each with its separator, fed after the solution's earlier steps as the committed history.
   "200 steps": the first 100 steps of each data set in file order; "all steps": every step of both
   (gzip alone).
2. Short repetitive legitimate steps (< 800 characters), built here: Markdown tables, truth tables, lists of
   equations, ``align*`` blocks, 1 + 1 + … + 1, zero matrices, enumerations.
3. Synthetic loops, 100 of each family: a real sentence repeated; one vocabulary token repeated (80 drawn
   uniformly from the vocabulary, 20 common short ones); cycles of 2–5 real sentences; numbers counting up
   (10 templates × 10 starts). Nothing contains the step end "\\n\\n" (that would end the step, not loop).
4. Incoherent text: token ids drawn uniformly from the vocabulary.
5. (issue 29) Loops across steps, 100: a real sentence as a whole step (``…\n\n``) committed three times,
   the candidate its fourth copy (50); two sentences as two steps, the pair committed three times, the
   candidate the first again (25); a sentence loop without a blank line that filled a whole step (512
   tokens, cut there), the candidate going on with it (25). Each is counted on the candidate alone.
6. (issue 29) Short units, 100: real sentences of 20–66 characters repeated, one character per token
   (the worst case: 512 tokens hold 512 characters). The repetitive legitimate steps are also fed after
   another one as their committed history (a compressible step before must not abort the next).

Without a model the entropy signal is unknown: every token is observed with entropy 0, so these numbers are
the gzip signal alone (incoherent text is then never caught: it does not compress). ``--model`` runs the
embedded model (``zoomr.factory.build_backend``) teacher-forced over the 200 steps, each problem's solve
prompt then its solution (``--model-steps`` of each set, to bound the time on a slow machine), and over
random-token steps after a GSM8K prompt, so both signals are read from
real per-token entropies (nats, the logits each token would have been sampled from).

    python benchmarks/detector_calibration.py [--json out.json] [--model [--model-steps 100]] [--incoherent 20]
        [--backend torch]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zoomr.backends.generation import StreamDecoder
from zoomr.backends.models import resolve_model
from zoomr.evaluation.datasets import records
from zoomr.rescue.degeneration import DegenerationDetector, DetectorConfig, entropy_nats, shortest_gzip_abort
from zoomr.rescue.loop import RescueConfig

STEP_TOKENS = RescueConfig().step_tokens
STEP_END = RescueConfig().step_end
PRIMES = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}


@dataclass(frozen=True)
class ConstantThreshold(DetectorConfig):
    """``before``: τ_cmp whatever the window's fill."""

    def gzip_threshold(self, chars: int) -> float:
        return self.min_gzip_ratio


@dataclass(frozen=True)
class FullWindowOnly(DetectorConfig):
    """``full_window``: no gzip abort before the window is full."""

    def gzip_threshold(self, chars: int) -> float:
        return self.min_gzip_ratio if chars >= self.gzip_window else 0.0


GZIP_ONLY = {"repeat_chars": 0, "max_copies": 0, "step_copies": 0}
VARIANTS = {"before": ConstantThreshold(**GZIP_ONLY), "scaled": DetectorConfig(**GZIP_ONLY), "after": DetectorConfig(),
            "full_window": FullWindowOnly(**GZIP_ONLY)}


@dataclass
class Text:
    """One text to feed: ``ids`` its tokens (tokens), ``entropies`` one per token (nats) or None (gzip alone)."""

    name: str
    family: str
    ids: list[int]
    entropies: list[float] | None = None
    history: str = ""              # committed steps before it (the detector reads their tail)
    chars: list[str] | None = None  # its pieces, when fed other than token by token (then ``ids`` is unused)


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token completes, as the generation loop streams it (may be empty)."""
    dec = StreamDecoder(tokenizer)
    return [dec.push(i) for i in ids]


def run_detector(config: DetectorConfig, text_pieces: list[str], entropies: list[float] | None,
                 history: str = "") -> dict:
    """Feed one text token by token after ``history``; the abort (token index, reason) and the smallest gzip
    margin seen.

    The margin is min over windows of ratio / threshold (> 1: that window was kept), so how close the text
    came to a repetition abort."""
    det = DegenerationDetector(config, history=history, step_end=STEP_END)
    margin = float("inf")
    for i, piece in enumerate(text_pieces):
        s = det.observe(piece, 0.0 if entropies is None else entropies[i])
        if piece and s.gzip_threshold > 0:
            margin = min(margin, s.gzip_ratio / s.gzip_threshold)
        if s.abort:
            return {"abort_at": i, "reason": s.abort, "margin": margin, "mean_entropy": s.mean_entropy}
    return {"abort_at": None, "reason": None, "margin": margin, "mean_entropy": det.signals.mean_entropy}


def evaluate(tokenizer, texts: list[Text], variants: dict[str, DetectorConfig]) -> dict[str, list[dict]]:
    """Every text through every variant: {variant: [result per text]}."""
    fed = [(t, t.chars[:STEP_TOKENS] if t.chars is not None else pieces(tokenizer, t.ids[:STEP_TOKENS]))
           for t in texts]
    return {v: [dict(run_detector(cfg, p, t.entropies, t.history), name=t.name, family=t.family) for t, p in fed]
            for v, cfg in variants.items()}


def summary(results: list[dict]) -> dict:
    """Counts of one variant over one set: aborted (by reason), rate, tokens to the abort, smallest margin."""
    hit = [r for r in results if r["abort_at"] is not None]
    at = [r["abort_at"] + 1 for r in hit]
    finite = [r["margin"] for r in results if r["margin"] != float("inf")]
    return {"texts": len(results), "aborted": len(hit), "rate": round(len(hit) / max(1, len(results)), 4),
            "by_reason": {k: sum(r["reason"] == k for r in hit) for k in ("entropy", "repetition", "cycle")},
            "median_tokens_to_abort": statistics.median(at) if at else None,
            "max_tokens_to_abort": max(at, default=None),
            "min_gzip_margin": round(min(finite), 3) if finite else None}


def by_family(results: list[dict]) -> dict:
    fams = sorted({r["family"] for r in results})
    return {f: summary([r for r in results if r["family"] == f]) for f in fams}


# ---- the sets ----------------------------------------------------------------------------------------------

def solution_steps(name: str) -> list[tuple[str, list[str]]]:
    """(question, steps) per problem; each step keeps the separator that ends it, as a committed step does."""
    out = []
    for rec in records(name):
        if name == "gsm8k":
            question, parts, sep = rec["question"], rec["answer"].split("\n"), "\n"
        else:
            question, parts, sep = rec["problem"], re.split(r"\n\s*\n", rec["solution"]), STEP_END
        parts = [p.strip("\n") for p in parts if p.strip()]
        out.append((question, [p + sep for p in parts[:-1]] + parts[-1:]))
    return out


def first_steps(problems: list[tuple[str, list[str]]], n: int) -> list[tuple[int, int]]:
    """(problem, step) indices of the first ``n`` steps in file order."""
    return [(i, j) for i, (_, steps) in enumerate(problems) for j in range(len(steps))][:n]


def table(head: list, rows: list[list]) -> str:
    line = lambda cells: "| " + " | ".join(map(str, cells)) + " |\n"
    return line(head) + "|" + "---|" * len(head) + "\n" + "".join(line(r) for r in rows)


def repetitive_legit_steps() -> dict[str, str]:
    """Short steps a solution may well contain that repeat themselves (< 800 characters each)."""
    out = {}
    for k in (6, 10, 15, 20):
        out[f"table_square_{k}"] = table(["x", "x^2"], [(i, i * i) for i in range(k)])
        out[f"table_pow2_{k}"] = table(["n", "2^n"], [(i, 2 ** i) for i in range(k)])
        out[f"table_mod3_{k}"] = table(["n", "n mod 3"], [(i, i % 3) for i in range(k)])
        out[f"table_prime_{k}"] = table(["n", "prime?"], [(i, "yes" if i in PRIMES else "no") for i in range(1, k + 1)])
        out[f"table_parity_{k}"] = table(["n", "parity"], [(i, "odd" if i % 2 else "even") for i in range(1, k + 1)])
    bits = [0, 1]
    out["truth_table_3"] = table(["p", "q", "r", "p and q"],
                                 [(a, b, c, a & b) for a in bits for b in bits for c in bits])
    out["truth_table_4"] = table(["a", "b", "c", "d", "xor"],
                                 [(a, b, c, d, a ^ b ^ c ^ d) for a in bits for b in bits for c in bits for d in bits])
    out["grid_8x8"] = table([""] + list("abcdefgh"), [[r] + ["."] * 8 for r in range(8, 0, -1)])
    out["mult_6x6"] = table(["×"] + list(range(1, 7)), [[i] + [i * j for j in range(1, 7)] for i in range(1, 7)])
    out["counts_zero"] = table(["outcome", "count"], [(a + b + c, 0) for a in "HT" for b in "HT" for c in "HT"])
    out["board_10x10"] = table([""] + list("abcdefghij"), [[r] + ["."] * 10 for r in range(10, 0, -1)])
    out["zeros_10x10"] = table(list(range(1, 11)), [[0] * 10 for _ in range(10)])
    out["identity_10"] = table([""] + list(range(1, 11)),
                               [[i] + [int(i == j) for j in range(1, 11)] for i in range(1, 11)])
    out["dp_init"] = table(["i"] + [f"j={j}" for j in range(6)], [[i] + [0] * 6 for i in range(12)])
    out["sudoku_empty"] = "\n".join(" ".join(["."] * 9) for _ in range(9))
    for k in (12, 20, 30):
        out[f"eq_times3_{k}"] = "".join(f"{i} \\times 3 = {3 * i}\n" for i in range(1, k + 1))
        out[f"eq_mod7_{k}"] = "".join(f"2^{{{i}}} \\equiv {pow(2, i, 7)} \\pmod{{7}}\n" for i in range(1, k + 1))
        out[f"eq_zero_{k}"] = "".join(f"x_{{{i}}} = 0\n" for i in range(1, k + 1))
        out[f"eq_one_{k}"] = "".join(f"f({i}) = 1\n" for i in range(1, k + 1))
        rows = "".join(f"a_{{{i}}} &= a_{{{i - 1}}} + 1 \\\\\n" for i in range(1, k + 1))
        out[f"align_{k}"] = "\\begin{align*}\n" + rows + "\\end{align*}"
        out[f"cases_{k}"] = "".join(f"Case {i}: x = {i}, so y = {2 * i}.\n" for i in range(1, k + 1))
    for k in (20, 40, 60):
        out[f"sum_ones_{k}"] = "$$S = " + " + ".join(["1"] * k) + f" = {k}$$"
        out[f"sum_x_{k}"] = "$$" + " + ".join(["x"] * k) + f" = {k}x$$"
    for k in (5, 10, 15):
        out[f"halves_{k}"] = "$$" + " \\cdot ".join(["\\frac{1}{2}"] * k) + f" = \\frac{{1}}{{{2 ** k}}}$$"
    for k in (4, 5, 6):
        row = " & ".join(["0"] * k)
        out[f"zero_matrix_{k}"] = "$$\\begin{pmatrix} " + " \\\\ ".join([row] * k) + " \\end{pmatrix}$$"
    out["coins"] = "The outcomes are " + ", ".join(a + b + c for a in "HT" for b in "HT" for c in "HT") + "."
    out["seq_pow2"] = "The sequence is " + ", ".join(str(2 ** i) for i in range(20)) + "."
    out["seq_const"] = "The sequence is " + ", ".join(["3"] * 30) + ", so it is constant."
    return {k: v for k, v in out.items() if len(v) < 800}


def sentences(problems: list[tuple[str, list[str]]]) -> list[str]:
    out = []
    for _, steps in problems:
        for step in steps:
            out += [s for s in re.split(r"(?<=[.!?])\s+", step.replace("\n", " ")) if 15 <= len(s) <= 150]
    return out


def looped(unit: str) -> str:
    """``unit`` repeated past what one step can hold (≥ 12 characters per token of the step limit)."""
    return unit * (STEP_TOKENS * 12 // len(unit) + 1)


COUNT_TEMPLATES = ["{n}, ", "{n}\n", "x = {n}, ", "Step {n}: add 1 to the total. ", "{n} + ", "a_{{{n}}} = {n}\n",
                   "{n} * 2 = {m}\n", "The number {n} is not the answer. ", "{n}. ", "Try n = {n}: no. "]
COMMON_TOKENS = [".", "1", "0", " the", " =", "+", "\\", "*", " ", "-", ",", " 1", " and", "a", "!", ")", " x", "2",
                 "$", " is"]


def loop_texts(tokenizer, sents: list[str], seed: int = 0) -> list[Text]:
    """The four loop families, 100 texts each (seeded)."""
    rng = random.Random(seed)
    enc = lambda s: tokenizer.encode(s, special=False)
    out = [Text(f"phrase_{i}", "phrase", enc(looped(s + " "))) for i, s in enumerate(rng.sample(sents, 100))]
    starts = rng.sample(range(len(sents) - 5), 100)
    for i, (k, at) in enumerate(zip([2, 3, 4, 5] * 25, starts)):
        unit = " ".join(sents[at:at + k]) + " "
        out.append(Text(f"cycle_{i}_period_{len(unit)}", "cycle", enc(looped(unit))))
    skip = set(tokenizer.eos_ids) | ({tokenizer.bos_id} if tokenizer.bos_id is not None else set())
    drawn = []
    while len(drawn) < 80:
        i = rng.randrange(tokenizer.vocab_size)
        t = tokenizer.decode([i])
        # a newline token repeated ends the step at "\n\n"; control tokens are not text
        if i not in skip and t and "\n" not in t and "\ufffd" not in t and not t.startswith("<|"):
            drawn.append(i)
    out += [Text(f"token_{i}", "token", [i] * STEP_TOKENS) for i in drawn]
    out += [Text(f"token_{s!r}", "token", enc(s) * STEP_TOKENS) for s in COMMON_TOKENS]
    for ti, tmpl in enumerate(COUNT_TEMPLATES):
        for start in (1, 2, 7, 10, 13, 50, 99, 100, 250, 1000):
            text, n = "", start
            while len(text) < STEP_TOKENS * 12:
                text += tmpl.format(n=n, m=2 * n)
                n += 1
            out.append(Text(f"count_{ti}_{start}", "count", enc(text)))
    for t in out:
        assert STEP_END not in tokenizer.decode(t.ids[:STEP_TOKENS]), t.name
    return out


def cross_step_loops(tokenizer, sents: list[str], seed: int = 2) -> list[Text]:
    """Set 5: loops whose copies are committed steps (or that filled one), the candidate one more copy."""
    rng = random.Random(seed)
    enc = lambda s: tokenizer.encode(s, special=False)
    picked = rng.sample(sents, 100)
    out = []
    for i, s in enumerate(picked[:50]):
        unit = s + STEP_END
        out.append(Text(f"steps1_{i}", "cross_step", enc(unit), history=unit * 3))
    for i in range(25):
        a, b = picked[50 + 2 * i] + STEP_END, picked[51 + 2 * i] + STEP_END
        out.append(Text(f"steps2_{i}", "cross_step", enc(a), history=(a + b) * 3))
    for i, s in enumerate(picked[:25]):
        ids = enc(looped(s + " "))
        # the loop filled a whole step (cut at the step limit); the candidate is its continuation
        out.append(Text(f"outlast_{i}", "cross_step", ids[STEP_TOKENS:2 * STEP_TOKENS],
                        history=tokenizer.decode(ids[:STEP_TOKENS])))
    return out


def short_unit_loops(sents: list[str], seed: int = 3) -> list[Text]:
    """Set 6: sentences of 20–66 characters repeated, one character per token."""
    rng = random.Random(seed)
    short = sorted({s for s in sents if 20 <= len(s) + 1 <= 66})
    return [Text(f"short_{i}_unit_{len(s) + 1}", "short_unit", [], chars=list(looped(s + " ")))
            for i, s in enumerate(rng.sample(short, 100))]


def random_token_ids(tokenizer, n: int, length: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    eos = np.fromiter(tokenizer.eos_ids, dtype=np.int64)
    out = []
    for _ in range(n):
        ids = rng.integers(0, tokenizer.vocab_size, length)
        out.append([int(i) for i in ids if i not in eos])  # an end-of-turn id would end the candidate
    return out


# ---- teacher forcing ---------------------------------------------------------------------------------------

def step_entropies(backend, prompt: list[int], steps: list[list[int]]) -> list[list[float]]:
    """Per-token entropies (nats) of each step, teacher-forced after ``prompt`` and the steps before it: token
    j's entropy is that of the distribution it would have been sampled from (the previous position's logits)."""
    seq = backend.new_sequence()
    try:
        last = backend.prefill(seq, prompt)                                        # [vocab]
        ids = [i for s in steps for i in s]
        logits = backend.prefill(seq, ids, all_logits=True)                        # [T, vocab]
    finally:
        backend.free(seq)
    h = [entropy_nats(last)] + [entropy_nats(row) for row in logits[:-1]]
    out, at = [], 0
    for s in steps:
        out.append(h[at:at + len(s)])
        at += len(s)
    return out


def model_texts(backend, sets: dict, n_random: int, random_len: int) -> tuple[list[Text], list[Text]]:
    """The 200 steps and ``n_random`` random-token steps, with the embedded model's entropies."""
    from zoomr.prompts import solve_prompt

    tok = backend.tokenizer
    real = []
    for name, (problems, picked) in sets.items():
        for p in sorted({i for i, _ in picked}):
            question, steps = problems[p]
            ids = [tok.encode(s, special=False) for s in steps]
            t0 = time.perf_counter()
            hs = step_entropies(backend, solve_prompt(tok, question), ids)
            print(f"  {name} problem {p}: {sum(map(len, ids))} tokens, {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
            real += [Text(f"{name}_{p}_{j}", name, ids[j], hs[j], history="".join(steps[:j]))
                     for i, j in picked if i == p]
    gsm = sets["gsm8k"][0]
    prompt = solve_prompt(tok, gsm[0][0])
    base = backend.new_sequence()
    incoherent = []
    try:
        last = backend.prefill(base, prompt)
        for k, ids in enumerate(random_token_ids(tok, n_random, random_len)):
            seq = backend.fork(base)
            try:
                logits = backend.prefill(seq, ids, all_logits=True)
            finally:
                backend.free(seq)
            incoherent.append(Text(f"random_{k}", "random", ids,
                                   [entropy_nats(last)] + [entropy_nats(r) for r in logits[:-1]]))
    finally:
        backend.free(base)
    return real, incoherent


# ---- report ------------------------------------------------------------------------------------------------

def run(a) -> int:
    t0 = time.perf_counter()
    backend = None
    if a.model:
        from zoomr.factory import build_backend
        from zoomr.options import RunOptions

        backend = build_backend(RunOptions(backend=a.backend, device="cpu", dtype="fp32", n_gpu_layers=0,
                                           ctx_size=4096, threads=a.threads))
        tok = backend.tokenizer
    else:
        from zoomr.backends.tokenizer import LlamaCppTokenizer

        tok = LlamaCppTokenizer(resolve_model(None).path)  # vocabulary only: no weights are needed
    probs = {name: solution_steps(name) for name in ("gsm8k", "math500")}
    picked = {name: (p, first_steps(p, 100)) for name, p in probs.items()}
    enc = lambda s: tok.encode(s, special=False)
    steps200 = [Text(f"{n}_{i}_{j}", n, enc(p[i][1][j]), history="".join(p[i][1][:j]))
                for n, (p, pk) in picked.items() for i, j in pk]
    all_steps = [Text(f"{n}_{i}_{j}", n, enc(s), history="".join(ss[:j])) for n, p in probs.items()
                 for i, (_, ss) in enumerate(p) for j, s in enumerate(ss)]
    legit_steps = repetitive_legit_steps()
    legit = [Text(k, "repetitive_legit", enc(v)) for k, v in legit_steps.items()]
    # each after the one before it (the first after the last) as its committed step: a compressible history
    # must not abort the next
    before = list(legit_steps.values())
    legit_after = [Text(t.name, "repetitive_legit_after", t.ids, history=prev + STEP_END)
                   for t, prev in zip(legit, before[-1:] + before[:-1])]
    sents = sentences(probs["gsm8k"]) + sentences(probs["math500"])
    loops = loop_texts(tok, sents)
    new_loops = cross_step_loops(tok, sents) + short_unit_loops(sents)
    randoms = [Text(f"random_{k}", "random", ids) for k, ids in enumerate(random_token_ids(tok, a.incoherent, 64))]
    print(f"sets built ({time.perf_counter() - t0:.0f} s): {len(steps200)} + {len(all_steps)} real steps, "
          f"{len(legit)} repetitive legitimate steps, {len(loops)} + {len(new_loops)} loops, "
          f"{len(randoms)} random-token steps",
          file=sys.stderr)

    # full_window aborts ⊆ before's: not rerun on 7097 steps
    two = {k: VARIANTS[k] for k in ("before", "scaled", "after")}
    gz = {"steps_200": evaluate(tok, steps200, VARIANTS), "all_steps": evaluate(tok, all_steps, two),
          "repetitive_legit": evaluate(tok, legit, VARIANTS), "loops": evaluate(tok, loops, VARIANTS),
          "repetitive_legit_after": evaluate(tok, legit_after, VARIANTS),
          "new_loops": evaluate(tok, new_loops, VARIANTS),
          "incoherent": evaluate(tok, randoms, VARIANTS)}
    print(f"gzip alone done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    report = {
        "detector": dataclasses.asdict(DetectorConfig()), "step_tokens": STEP_TOKENS,
        "shortest_gzip_abort_chars": {v: shortest_gzip_abort(c) for v, c in VARIANTS.items()},
        "gzip_alone": {
            "false_aborts": {s: {v: summary(r) for v, r in gz[s].items()}
                             for s in ("steps_200", "all_steps", "repetitive_legit", "repetitive_legit_after")},
            "repetitive_legit_aborted": {v: [r["name"] for r in rs if r["abort_at"] is not None]
                                         for v, rs in gz["repetitive_legit"].items()},
            "real_steps_aborted": {v: [r["name"] for r in rs if r["abort_at"] is not None]
                                   for v, rs in gz["all_steps"].items()},
            "detection": {v: dict(by_family(gz["loops"][v] + gz["incoherent"][v]),
                                  loops=summary(gz["loops"][v]),
                                  all=summary(gz["loops"][v] + gz["incoherent"][v])) for v in VARIANTS},
            "detection_issue29": {v: by_family(gz["new_loops"][v]) for v in VARIANTS},
            "short_unit_by_length": {v: unit_bins(gz["new_loops"][v]) for v in VARIANTS},
            "cycle_detection_by_period": {v: period_bins(gz["loops"][v]) for v in VARIANTS},
            "count_detection_by_template": {v: template_bins(gz["loops"][v]) for v in VARIANTS},
        },
        "model": None,
    }
    if backend is not None:
        print("teacher forcing the embedded model:", file=sys.stderr)
        some = {name: (p, pk[:a.model_steps]) for name, (p, pk) in picked.items()}
        real, incoherent = model_texts(backend, some, a.incoherent, 64)
        m_real, m_inc = evaluate(tok, real, VARIANTS), evaluate(tok, incoherent, VARIANTS)
        report["model"] = {
            "backend": backend.describe(),
            "steps_per_data_set": a.model_steps,
            "false_aborts_steps": {v: summary(r) for v, r in m_real.items()},
            "max_mean_entropy_steps": round(max(max_window_mean(t.entropies) for t in real), 3),
            "detection_incoherent": {v: summary(r) for v, r in m_inc.items()},
            "detection_all": {v: summary(gz["loops"][v] + m_inc[v]) for v in VARIANTS},
            "note": "loops are counted on the gzip signal alone (entropy 0): a loop's entropy only adds aborts",
        }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print_report(report)
    if a.json:
        out = json.dumps(report, indent=2)
        sys.stdout.write(out + "\n") if a.json == "-" else Path(a.json).write_text(out)
    return 0


def max_window_mean(h: list[float], w: int = DetectorConfig().entropy_window) -> float:
    return max((sum(h[i:i + w]) / w for i in range(max(1, len(h) - w + 1))), default=0.0)


def period_bins(results: list[dict]) -> dict:
    cyc = [(int(r["name"].rsplit("_", 1)[1]), r["abort_at"] is not None) for r in results if r["family"] == "cycle"]
    bins = {"period<=150": (0, 150), "150<period<=250": (151, 250), "period>250": (251, 1 << 30)}
    return {k: f"{sum(d for p, d in cyc if lo <= p <= hi)}/{sum(lo <= p <= hi for p, _ in cyc)}"
            for k, (lo, hi) in bins.items()}


def unit_bins(results: list[dict]) -> dict:
    """Short-unit loops caught within the step, by unit length (characters)."""
    units = [(int(r["name"].rsplit("_", 1)[1]), r["abort_at"] is not None) for r in results
             if r["family"] == "short_unit"]
    bins = {"unit<=33": (0, 33), "34<=unit<=66": (34, 66)}
    return {k: f"{sum(d for u, d in units if lo <= u <= hi)}/{sum(lo <= u <= hi for u, _ in units)}"
            for k, (lo, hi) in bins.items()}


def template_bins(results: list[dict]) -> dict:
    cnt = [r for r in results if r["family"] == "count"]
    return {COUNT_TEMPLATES[t]: f"{sum(r['abort_at'] is not None for r in cnt if r['name'].split('_')[1] == str(t))}/10"
            for t in range(len(COUNT_TEMPLATES))}


def _cols(d: dict, key: str, names=("before", "scaled", "after")) -> str:
    """``a → b → c`` of one count over the variants."""
    return " → ".join(f"{d[v][key]}/{d[v]['texts']}" for v in names if v in d)


def print_report(r: dict) -> None:
    g = r["gzip_alone"]
    print("text signals alone (entropy 0): before → scaled → after (full-window-only rule in parentheses)")
    for s, label in (("steps_200", "200 solution steps"), ("all_steps", "all solution steps"),
                     ("repetitive_legit", "short repetitive legit steps"),
                     ("repetitive_legit_after", "the same after another as history")):
        f = g["false_aborts"][s]
        fw = f" ({f['full_window']['aborted']})" if "full_window" in f else ""
        print(f"  false aborts, {label}: {_cols(f, 'aborted')}{fw}; smallest gzip margin "
              f"{f['before']['min_gzip_margin']} → {f['after']['min_gzip_margin']}")
    print(f"  repetitive legit aborted before: {', '.join(g['repetitive_legit_aborted']['before']) or 'none'}; "
          f"after: {', '.join(g['repetitive_legit_aborted']['after']) or 'none'}")
    d = g["detection"]
    for fam in [k for k in d["after"] if k not in ("loops", "all")] + ["loops", "all"]:
        cols = {v: d[v][fam] for v in VARIANTS}
        print(f"  detection {fam:>7}: {_cols(cols, 'aborted')} ({cols['full_window']['aborted']}); median tokens "
              f"{' → '.join(str(cols[v]['median_tokens_to_abort']) for v in ('before', 'scaled', 'after'))}; "
              f"by reason after {cols['after']['by_reason']}")
    d = g["detection_issue29"]
    for fam in d["after"]:
        cols = {v: d[v][fam] for v in VARIANTS}
        print(f"  detection {fam}: {_cols(cols, 'aborted')}; median tokens "
              f"{' → '.join(str(cols[v]['median_tokens_to_abort']) for v in ('before', 'scaled', 'after'))}; "
              f"max {cols['after']['max_tokens_to_abort']}; by reason after {cols['after']['by_reason']}")
    print(f"  short units by length (scaled → after): {g['short_unit_by_length']['scaled']} → "
          f"{g['short_unit_by_length']['after']}")
    for v in ("scaled", "after"):
        print(f"  cycles by period ({v}): {g['cycle_detection_by_period'][v]}")
        print(f"  counting by template ({v}): {g['count_detection_by_template'][v]}")
    if r["model"]:
        m = r["model"]
        f, i, al = m["false_aborts_steps"], m["detection_incoherent"], m["detection_all"]
        print(f"with the embedded model's entropies ({m['backend']}):")
        print(f"  false aborts, first {m['steps_per_data_set']} steps of each set: {_cols(f, 'aborted')} (by reason "
              f"after: {f['after']['by_reason']}); highest 12-token mean entropy {m['max_mean_entropy_steps']} nats")
        print(f"  detection, random tokens: {_cols(i, 'aborted')}; median tokens {i['after']['median_tokens_to_abort']}")
        print(f"  detection, loops + random tokens: {_cols(al, 'aborted')}")
    print(f"({r['seconds']} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the report here ('-': stdout)")
    ap.add_argument("--model", action="store_true", help="also teacher-force the embedded model for entropies")
    ap.add_argument("--backend", default="torch", help="backend for --model (torch or llamacpp)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--model-steps", type=int, default=100,
                    help="with --model: the first N of each data set's 100 steps are teacher-forced (default all)")
    ap.add_argument("--incoherent", type=int, default=20, help="random-token steps (64 tokens each)")
    raise SystemExit(run(ap.parse_args()))


if __name__ == "__main__":
    main()
