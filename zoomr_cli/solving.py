"""Solving one problem on a loaded model: prompt → prefill → streamed decode → the \\boxed{} answer and KV stats.

What ``zoomr solve`` runs (the command only parses flags and renders a :class:`SolveResult`); the JSON
record of ``--json`` is :meth:`SolveResult.record`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from zoomr.backends.base import Backend, KVStats
from zoomr.backends.generation import GenerationStats, generate
from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.errors import UserError, check_text
from zoomr.grading import extract_answer
from zoomr.prompts import solve_prompt, solve_system

# generation that ended before the model chose to stop: a \boxed{} still open then is no answer
TRUNCATED = ("length", "context", "interrupted")


@dataclass
class SolveResult:
    """One solved problem.

    Attributes:
        problem: the problem text as given.
        answer: the last closed ``\\boxed{}`` of the text, else the "the answer is …" expression; None when
            there is neither (see :func:`zoomr.grading.extract_answer`).
        stats: what generation did (tokens, seconds, the generated ids and text, the stop reason).
        kv: KV accounting of the sequence at the end (tokens, bytes; see :class:`zoomr.kvstore.stats.KVStats`).
        model: ``backend.describe()``: model, backend, device, dtype, KV policy.
        sampling: the sampling settings used.
    """

    problem: str
    answer: str | None
    stats: GenerationStats
    kv: KVStats
    model: str
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def text(self) -> str:
        """The generated text (the model's reasoning and answer)."""
        return self.stats.text

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids, EOS excluded (tokens)."""
        return self.stats.token_ids

    @property
    def stop_reason(self) -> str:
        """``eos``, ``length`` (``n_predict`` reached), ``context`` (the backend's ``n_ctx`` reached) or
        ``interrupted`` (Ctrl-C)."""
        return self.stats.stop_reason

    def record(self) -> dict:
        """The JSON-ready record ``zoomr solve --json`` writes: problem, text, answer, token counts, stop
        reason, model, sampling, ``kv`` (:meth:`KVStats.as_dict`) and ``timing`` (seconds, tokens/second)."""
        g = self.stats
        return {
            "problem": self.problem,
            "text": g.text,
            "answer": self.answer,
            "tokens_generated": g.generated_tokens,
            "prompt_tokens": g.prompt_tokens,
            "stop_reason": g.stop_reason,
            "model": self.model,
            "sampling": asdict(self.sampling),
            "kv": self.kv.as_dict(),
            "timing": {"prefill_s": round(g.prefill_s, 4), "decode_s": round(g.decode_s, 4),
                       "prefill_tok_s": round(g.prefill_tok_s, 2), "decode_tok_s": round(g.decode_tok_s, 2)},
        }


def fit_prompt(tokenizer, problem: str, system: str | None, n_ctx: int) -> list[int]:
    """The solve prompt's token ids (:func:`zoomr.prompts.solve_prompt`), checked to leave room in the context
    for at least one generated token: what :func:`solve` does before the model runs.

    Args:
        tokenizer: the model's tokenizer (``backend.tokenizer``).
        problem: the problem text (no template); ``system``: an optional system message.
        n_ctx: the context size (tokens).
    Returns:
        token ids (tokens), fewer than ``n_ctx``.
    Raises:
        UserError: the problem or system text is not valid Unicode (see :func:`zoomr.errors.check_text`), or
            the prompt has ``n_ctx`` tokens or more.
        zoomr.backends.chat_template.ChatTemplateError: the model's template does not render.
    """
    check_text(problem, "the problem")
    if system is not None:
        check_text(system, "the system message")
    ids = solve_prompt(tokenizer, problem, system)
    check_fits(len(ids), n_ctx)
    return ids


def solve_ids(backend: Backend, problem: str, system: str | None = None, n_ctx: int | None = None) -> list[int]:
    """The prompt a solve on ``backend`` prefills: :func:`fit_prompt` with the system message
    :func:`zoomr.prompts.solve_system` makes for the backend's KV policy (the summary instruction under
    ``--summaries prompted``). :func:`solve`, :func:`zoomr.run_rescue` and the CLI (to refuse a long prompt
    before it prints anything else) all build their prompts here, so they are the same token ids.

    Args:
        backend: a loaded model (:func:`zoomr.load`); its tokenizer and policy are read.
        problem: the problem text (no template); ``system``: the caller's system message, or None.
        n_ctx: the context the prompt must leave room in (tokens); None = ``backend.n_ctx``.
    Returns:
        token ids (tokens), fewer than the context.
    Raises:
        UserError, ChatTemplateError: see :func:`fit_prompt`.
    """
    return fit_prompt(backend.tokenizer, problem, solve_system(backend, system),
                      backend.n_ctx if n_ctx is None else n_ctx)


def check_fits(prompt_tokens: int, n_ctx: int) -> None:
    """A prompt of ``prompt_tokens`` leaves room for a generated token in a context of ``n_ctx`` (tokens).

    Raises:
        UserError: ``the prompt has N tokens, more than -c N_CTX allows``.
    """
    if prompt_tokens >= n_ctx:
        raise UserError(f"the prompt has {prompt_tokens} tokens, more than -c {n_ctx} allows")


def solve(backend: Backend, problem: str, *, system: str | None = None, sampling: SamplingParams | None = None,
          n_predict: int = 512, ignore_eos: bool = False,
          on_token: Callable[[str], None] | None = None) -> SolveResult:
    """Reason step by step on ``problem`` in a fresh sequence of ``backend`` and extract the answer.

    The prompt is :func:`solve_ids`: :func:`zoomr.prompts.solve_prompt` (the problem + "put your final
    answer within \\boxed{}", in the model's chat template) with the system message the backend's policy
    asks for (:func:`zoomr.prompts.solve_system`), as ``zoomr solve`` sends it. The KV policy is the
    backend's own (``zoomr.load(..., policy=...)``); its sequence is freed before returning, after its
    :class:`KVStats` were read. Ctrl-C (KeyboardInterrupt) during generation ends it early: the result
    holds what was generated, with ``stop_reason`` ``interrupted``.

    Args:
        backend: a loaded model (:func:`zoomr.load`).
        problem: the problem text (no template).
        system: the system message; under a policy that reads ``summaries`` with ``summaries="prompted"``
            (sumr, zoomr) the instruction to write delimited summaries is appended
            (:func:`zoomr.prompts.solve_system`).
        sampling: temperature, top-k, top-p, seed; default greedy (temperature 0).
        n_predict: most tokens to generate (tokens); -1 = until EOS or the context is full.
        ignore_eos: never sample end-of-sequence, so exactly ``n_predict`` tokens come (llama.cpp's flag).
        on_token: called with each token's text as it is generated (may be ``""`` mid UTF-8 character).
    Returns:
        the :class:`SolveResult`.
    Raises:
        UserError: the prompt does not fit the backend's context (``n_ctx`` tokens), or its text is not
            valid Unicode (see :func:`fit_prompt`).
        ValueError: invalid sampling values.
        zoomr.backends.base.BackendError: the model runtime failed.
    """
    params = (sampling or SamplingParams()).validate()
    sampler = Sampler(params)
    ids = solve_ids(backend, problem, system)
    gen = GenerationStats()
    seq = backend.new_sequence()
    try:
        try:
            for tok in generate(backend, seq, ids, sampler, n_predict, gen, ignore_eos=ignore_eos):
                if on_token is not None:
                    on_token(tok.text)
        except KeyboardInterrupt:
            gen.stop_reason = "interrupted"
        kv = backend.kv_stats(seq)
    finally:
        backend.free(seq)
    answer = extract_answer(gen.text, truncated=gen.stop_reason in TRUNCATED)
    return SolveResult(problem, answer, gen, kv, backend.describe(), params)
