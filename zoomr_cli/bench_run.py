"""Running one (problem, policy, budget) cell of ``zoomr bench``: a free-running generation for accuracy,
memory and speed, then a teacher-forced pass over full KV's tokens for fidelity."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from backends.base import Backend
from backends.generation import GenerationStats, generate
from backends.sampling import Sampler, SamplingParams

from .bench_metrics import FidelityMeter
from .datasets import Problem
from .grading import extract_answer, grade

TRACE_EVERY = 8  # tokens between samples of the active-KV trace kept for plots


@dataclass
class Reference:
    """Full KV's run of one problem, the yardstick of fidelity.

    Attributes:
        tokens: generated ids, [n].
        logits: float32 [n, vocab]; row i is the distribution token i was sampled from.
    """

    tokens: list[int]
    logits: np.ndarray


def run_cell(backend: Backend, problem: Problem, prompt: list[int], sampling: SamplingParams, n_predict: int,
             reference: Reference | None, keep_logits: bool = False) -> tuple[dict, Reference | None]:
    """Generate on ``backend`` (which carries the policy) and measure.

    Args:
        backend: a backend view whose new sequences use the policy under test.
        prompt: prompt token ids (tokens).
        reference: full KV's run; None for the full run itself (which then returns its Reference when
            ``keep_logits``) or when fidelity is skipped.
    Returns:
        (record fields, the Reference built from this run or None).
    """
    seq = backend.new_sequence()
    gen = GenerationStats()
    trace, active_sum, steps = [], 0, 0
    rows = []
    t0 = time.perf_counter()
    try:
        for tok in generate(backend, seq, prompt, Sampler(sampling), n_predict, gen):
            if keep_logits:
                rows.append(tok.logits)
            kv = backend.kv_stats(seq)
            active_sum += kv.active_tokens
            steps += 1
            if steps % TRACE_EVERY == 1:
                trace.append([kv.full_tokens - len(prompt), kv.active_tokens])
        kv = backend.kv_stats(seq)
        if steps and (not trace or trace[-1][0] != kv.full_tokens - len(prompt)):
            trace.append([kv.full_tokens - len(prompt), kv.active_tokens])  # the curve ends where the run did
    finally:
        backend.free(seq)
    answer = extract_answer(gen.text)
    token_bytes = kv.full_bytes // max(kv.full_tokens, 1)
    mean_active = active_sum / steps if steps else kv.active_tokens
    record = {
        "answer": answer,
        "correct": grade(problem.gold, answer),
        "tokens_generated": gen.generated_tokens,
        "stop_reason": gen.stop_reason,
        "degenerate": gen.stop_reason in ("length", "context") and answer is None,
        "kv_mean_active_tokens": round(mean_active, 2),
        "kv_peak_active_tokens": kv.peak_active_tokens,
        "kv_mean_active_bytes": int(mean_active * token_bytes),
        "full_tokens": kv.full_tokens,
        "full_bytes": kv.full_bytes,
        "saving": round(kv.saving, 3),  # full / active bytes at the end of the run
        "decode_tok_s": round(gen.decode_tok_s, 2),
        "prefill_tok_s": round(gen.prefill_tok_s, 2),
        "active_trace": trace,
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
        ``{"fidelity_top1": fraction, "fidelity_kl": nats/token, "fidelity_tokens": n}``.
    """
    meter = FidelityMeter()
    seq = backend.new_sequence()
    try:
        logits = backend.prefill(seq, prompt)
        for i, token in enumerate(ref.tokens):
            meter.add(ref.logits[i], logits)
            if i + 1 < len(ref.tokens):
                logits = backend.decode(seq, token)
    finally:
        backend.free(seq)
    return meter.result()
