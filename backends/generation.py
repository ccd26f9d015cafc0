"""Backend-neutral prefill + decode loop with streaming detokenization and timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .base import Backend, Sequence, Tokenizer
from .sampling import Sampler


class StreamDecoder:
    """Turns a stream of token ids into text deltas without splitting UTF-8 characters.

    Decodes a short window of recent ids twice per token (prefix-offset method) so tokenizers that
    change a token's text depending on its neighbours (leading spaces) stream correctly; a delta that
    would end inside a multi-byte character is held back until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        """Add one id; return the new text it completes (may be empty)."""
        self.ids.append(token)
        prev = self.tok.decode(self.ids[self._prefix:self._read])
        cur = self.tok.decode(self.ids[self._prefix:])
        if cur.endswith("\ufffd") and len(self.ids) - self._read < 8:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return cur[len(prev):]


@dataclass
class TokenOut:
    """One generated token.

    Attributes:
        token: the sampled id.
        text: the text this token completes (may be empty mid UTF-8 character).
        logits: float32 [vocab], the distribution ``token`` was sampled from (for entropy signals).
    """

    token: int
    text: str
    logits: np.ndarray


@dataclass
class GenerationStats:
    """What one generation did, in tokens and seconds.

    Attributes:
        prompt_tokens: tokens prefilled (tokens).
        generated_tokens: tokens sampled (tokens), EOS excluded.
        prefill_s: wall time of the prefill forward (seconds).
        decode_s: wall time of all decode forwards (seconds).
        decode_steps: number of decode forwards (tokens).
        stop_reason: "eos", "length" (``-n`` reached), "context" (``-c`` reached), "stop" (a stop string)
            or "interrupted" (Ctrl-C).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    stop_reason: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    next_logits: np.ndarray | None = None  # [vocab]: the sequence's next-token logits when generation ended

    @property
    def prefill_tok_s(self) -> float:
        """Prefill throughput (tokens/second)."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput (tokens/second)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def generate(backend: Backend, seq: Sequence, prompt_ids: list[int], sampler: Sampler, n_predict: int,
             stats: GenerationStats, stop: tuple[str, ...] = (), logits: np.ndarray | None = None,
             ignore_eos: bool = False) -> Iterator[TokenOut]:
    """Prefill ``prompt_ids`` into ``seq``, then sample up to ``n_predict`` tokens, yielding each one.

    ``stats`` is filled in as generation proceeds, so a caller interrupted (Ctrl-C) mid-way still
    holds everything computed so far; the caller sets ``stop_reason = "interrupted"`` then.
    Every accepted token is decoded into the cache (so a chat continues from it); EOS is not.

    Args:
        backend, seq: where to run.
        prompt_ids: tokens to prefill; may be empty when ``logits`` (the [vocab] next-token logits of
            ``seq`` as it stands, e.g. a fork of a committed state) are given instead.
        n_predict: most tokens to generate (tokens); < 0 means until EOS or the context is full.
        stop: strings that end generation when the text so far ends with one of them.
        ignore_eos: never sample an end-of-sequence id (its logit is taken as −inf for sampling only, as
            llama.cpp's ``--ignore-eos``), so generation runs to ``n_predict``; yielded logits stay raw.
    Raises:
        ValueError: the prompt does not fit the context, or neither prompt_ids nor logits given.
    """
    if prompt_ids:
        t0 = time.perf_counter()
        logits = backend.prefill(seq, prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        stats.prompt_tokens = len(prompt_ids)
    elif logits is None:
        raise ValueError("generate needs prompt tokens or the sequence's next-token logits")
    stats.next_logits = logits
    detok = StreamDecoder(backend.tokenizer)
    eos = backend.tokenizer.eos_ids
    limit = n_predict if n_predict >= 0 else 1 << 62
    banned = np.fromiter(eos, dtype=np.int64) if ignore_eos and eos else None
    while stats.generated_tokens < limit:
        if banned is not None:
            masked = logits.copy()
            masked[banned] = -np.inf
            token = sampler.sample(masked)
        else:
            token = sampler.sample(logits)
        if token in eos:
            stats.stop_reason = "eos"
            return
        stats.generated_tokens += 1
        stats.token_ids.append(token)
        delta = detok.push(token)
        stats.text += delta
        yield TokenOut(token, delta, logits)
        if len(seq.tokens) >= backend.n_ctx:
            stats.stop_reason = "context"
            return
        # every accepted token goes into the cache, so a chat can continue from it
        t = time.perf_counter()
        logits = backend.decode(seq, token)
        stats.decode_s += time.perf_counter() - t
        stats.decode_steps += 1
        stats.next_logits = logits
        if stop and any(stats.text.endswith(s) for s in stop):
            stats.stop_reason = "stop"
            return
    stats.stop_reason = "length"
