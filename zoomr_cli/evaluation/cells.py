"""What one (problem, policy, budget) cell of ``zoomr bench`` records: its prompt, its record fields from a
finished free-running generation (accuracy, memory, speed), and full KV's run as the fidelity yardstick.
The generation and the teacher-forced fidelity pass themselves run in :mod:`zoomr.evaluation.batching`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoomr.backends.base import KVStats
from zoomr.backends.generation import GenerationStats

from zoomr.evaluation.datasets import Problem
from zoomr.errors import UserError
from zoomr.grading import extract, grade
from zoomr.solving import fit_prompt


@dataclass
class Reference:
    """Full KV's run of one problem, the yardstick of fidelity.

    Attributes:
        tokens: generated ids, [n].
        logits: float32 [n, vocab] on the backend's device (fidelity is computed there); row i is the
            distribution token i was sampled from.
    """

    tokens: list[int]
    logits: torch.Tensor


# the KVStats fields every record carries (see backends.base.KVStats); rescue records carry the base's
KV_FIELDS = ("mean_active_tokens", "peak_active_tokens", "bound_tokens", "bound_measured", "mean_active_bytes",
             "peak_active_bytes", "full_tokens", "full_bytes", "mean_full_bytes", "saving", "saving_peak",
             "device_kv_bytes", "host_kv_bytes", "policy_state_bytes", "mean_policy_state_bytes", "kv_device")


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


def cell_record(problem: Problem, prompt: list[int], gen: GenerationStats, kv: KVStats,
                points: list[tuple[int, int]], wall_s: float) -> dict:
    """The record fields of one finished free-running generation.

    Args:
        prompt: the prompt's ids (tokens); gen: what the generation did; kv: the sequence's KV at the end.
        points: (generated tokens, active tokens) before each accepted token's decode.
        wall_s: the cell's wall time (seconds), prefill included.
    Returns:
        answer, correctness and its audit fields, lengths, stop reason, the fields of :data:`KV_FIELDS`,
        decode/prefill tokens/s, ``active_trace`` (:func:`breakpoints`), ``kv_extra``, ``text``, ``wall_s``.
    """
    # a run stopped by -n or -c may end mid-answer: the stricter extraction (a cut answer is no answer)
    found = extract(gen.text, truncated=gen.stop_reason in ("length", "context"))
    answer = found.answer
    return {
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
        "wall_s": round(wall_s, 3),
    }
