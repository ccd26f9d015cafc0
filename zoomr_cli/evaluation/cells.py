"""Running one (problem, policy, budget) cell of ``zoomr bench``: a free-running generation for accuracy,
memory and speed, then a teacher-forced pass over full KV's tokens for fidelity."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from zoomr.backends.base import Backend, KVStats
from zoomr.backends.generation import GenerationStats, generate
from zoomr.backends.sampling import Sampler, SamplingParams

from zoomr.evaluation.metrics import FidelityMeter
from zoomr.evaluation.datasets import Problem
from zoomr.errors import UserError
from zoomr.grading import extract, grade
from zoomr.solving import fit_prompt


@dataclass
class Reference:
    """Full KV's run of one problem, the yardstick of fidelity.

    Attributes:
        tokens: generated ids, [n].
        logits: float32 [n, vocab]; row i is the distribution token i was sampled from.
    """

    tokens: list[int]
    logits: np.ndarray


# the KVStats fields every record carries (see backends.base.KVStats); rescue records carry the base's
KV_FIELDS = ("mean_active_tokens", "peak_active_tokens", "bound_tokens", "bound_measured", "mean_active_bytes",
             "peak_active_bytes", "full_tokens", "full_bytes", "mean_full_bytes", "saving", "saving_peak",
             "device_kv_bytes", "host_kv_bytes", "kv_device")


def problem_prompt(tokenizer, problem: Problem, n_ctx: int) -> list[int]:
    """The solve prompt's token ids of a data-set problem, checked as ``zoomr solve`` checks its own
    (:func:`zoomr.solving.fit_prompt`: valid Unicode, room for a generated token in ``n_ctx`` tokens).

    Raises:
        UserError: one line naming the problem, e.g. ``problem gsm8k/3: the prompt has 115 tokens, more than
            -c 64 allows``.
    """
    try:
        return fit_prompt(tokenizer, problem.question, None, n_ctx)
    except UserError as e:
        raise UserError(f"problem {problem.id}: {e}") from None


def kv_fields(kv: KVStats) -> dict:
    """The record's KV figures from a finished sequence's :class:`KVStats` (tokens, bytes, ×)."""
    d = kv.as_dict()
    return {k: d[k] for k in KV_FIELDS}


def breakpoints(points: list[tuple[int, int]]) -> list[list[int]]:
    """Drop the points of a polyline that lie on a straight run, keeping every corner (an eviction, a
    selection, the end): the curve through the result is the curve through ``points``, exactly.

    Args:
        points: (generated tokens, active tokens) per decode step, in order.
    Returns:
        [[x, y], ...], first and last point always kept.
    """
    out: list[list[int]] = []
    for x, y in points:
        if len(out) >= 2:
            (x0, y0), (x1, y1) = out[-2], out[-1]
            if (y1 - y0) * (x - x1) == (y - y1) * (x1 - x0):  # collinear: extend the run
                out[-1] = [x, y]
                continue
        out.append([x, y])
    return out


def run_cell(backend: Backend, problem: Problem, prompt: list[int], sampling: SamplingParams, n_predict: int,
             reference: Reference | None, keep_logits: bool = False, ignore_eos: bool = False
             ) -> tuple[dict, Reference | None]:
    """Generate on ``backend`` (which carries the policy) and measure.

    Args:
        backend: a backend view whose new sequences use the policy under test.
        prompt: prompt token ids (tokens).
        reference: full KV's run; None for the full run itself (which then returns its Reference when
            ``keep_logits``) or when fidelity is skipped.
        ignore_eos: generate to ``n_predict`` without ever sampling EOS (see ``zoomr.backends.generation.generate``).
    Returns:
        (record fields, the Reference built from this run or None). KV fields are those of
        :data:`KV_FIELDS`; ``active_trace`` is the exact active-KV curve as breakpoints
        ``[generated tokens, active tokens]`` (see :func:`breakpoints`).
    """
    seq = backend.new_sequence()
    gen = GenerationStats()
    points: list[tuple[int, int]] = []
    rows = []
    t0 = time.perf_counter()
    try:
        for tok in generate(backend, seq, prompt, Sampler(sampling), n_predict, gen, ignore_eos=ignore_eos):
            if keep_logits:
                rows.append(tok.logits)
            kv = backend.kv_stats(seq)
            points.append((kv.full_tokens - len(prompt), kv.active_tokens))
        kv = backend.kv_stats(seq)
    finally:
        backend.free(seq)
    # a run stopped by -n or -c may end mid-answer: the stricter extraction (a cut answer is no answer)
    found = extract(gen.text, truncated=gen.stop_reason in ("length", "context"))
    answer = found.answer
    record = {
        "answer": answer,
        "correct": grade(problem.gold, answer),
        "answer_source": found.source,
        "n_boxed_distinct": found.n_boxed_distinct,
        "prompt_tokens": len(prompt),
        "tokens_generated": gen.generated_tokens,
        "stop_reason": gen.stop_reason,
        "no_answer_at_cap": gen.stop_reason in ("length", "context") and answer is None,
        **kv_fields(kv),
        "decode_tok_s": round(gen.decode_tok_s, 2),
        "prefill_tok_s": round(gen.prefill_tok_s, 2),
        "active_trace": breakpoints(points),
        "kv_extra": kv.extra,
        "text": gen.text,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if reference is not None:
        record.update(teacher_forced_fidelity(backend, prompt, reference))
    built = Reference(gen.token_ids, np.stack(rows)) if keep_logits and rows else None
    return record, built


def teacher_forced_fidelity(backend: Backend, prompt: list[int], ref: Reference) -> dict:
    """Feed full KV's tokens through the policy and compare next-token distributions position by position.

    Same code path as generation (prefill, then one decode per token), so only the KV policy differs.

    Returns:
        ``{"fidelity_top1": fraction, "fidelity_kl": nats/token, "fidelity_tokens": n,
        "fidelity_mean_active_tokens": the teacher-forced pass's own time-averaged active KV (tokens)}``.
    """
    meter = FidelityMeter()
    seq = backend.new_sequence()
    try:
        logits = backend.prefill(seq, prompt)
        for i, token in enumerate(ref.tokens):
            meter.add(ref.logits[i], logits)
            if i + 1 < len(ref.tokens):
                logits = backend.decode(seq, token)
        mean_active = backend.kv_stats(seq).mean_active_tokens
    finally:
        backend.free(seq)
    return {**meter.result(), "fidelity_mean_active_tokens": round(mean_active, 2)}
