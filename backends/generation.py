"""Backend-neutral prefill + decode loop with streaming detokenization and timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

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
        logits: float32 [vocab], the distribution ``token`` was sampled from (for entropy signals);
            None from :func:`generate_batch`, whose rows stay on the device.
        entropy: entropy of softmax(logits) (nats) when computed on the device, else None.
    """

    token: int
    text: str
    logits: np.ndarray | None
    entropy: float | None = None


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


class SequenceProgress:
    """One sequence's per-token bookkeeping, shared by :func:`generate`, :func:`generate_batch` and the
    bench's continuous batching (``zoomr.evaluation.batching``): EOS, the token limit, streaming text, the
    context cap and stop strings, in that order per token."""

    def __init__(self, backend: Backend, seq: Sequence, n_predict: int, stats: GenerationStats,
                 stop: tuple[str, ...]):
        self.backend, self.seq, self.stats, self.stop = backend, seq, stats, stop
        self.detok = StreamDecoder(backend.tokenizer)
        self.eos = backend.tokenizer.eos_ids
        self.limit = n_predict if n_predict >= 0 else 1 << 62

    def has_room(self) -> bool:
        """False (and stop reason ``length``) once the token limit is reached."""
        if self.stats.generated_tokens < self.limit:
            return True
        self.stats.stop_reason = "length"
        return False

    def accept(self, token: int) -> str | None:
        """Take a sampled id: None (stop reason ``eos``) for an end-of-sequence id, else the text it completes."""
        if token in self.eos:
            self.stats.stop_reason = "eos"
            return None
        self.stats.generated_tokens += 1
        self.stats.token_ids.append(token)
        delta = self.detok.push(token)
        self.stats.text += delta
        return delta

    def context_full(self) -> bool:
        """True (stop reason ``context``) when the cache cannot take the accepted token."""
        if len(self.seq.tokens) >= self.backend.n_ctx:
            self.stats.stop_reason = "context"
            return True
        return False

    def decoded(self, seconds: float) -> bool:
        """Count one decode forward of ``seconds``; True (stop reason ``stop``) when a stop string ends the text."""
        self.stats.decode_s += seconds
        self.stats.decode_steps += 1
        if self.stop and any(self.stats.text.endswith(s) for s in self.stop):
            self.stats.stop_reason = "stop"
            return True
        return False


def banned_ids(backend: Backend, ignore_eos: bool) -> np.ndarray | None:
    """The ids ``--ignore-eos`` never samples (the tokenizer's end ids, int64 [k]), or None without it."""
    eos = backend.tokenizer.eos_ids
    return np.fromiter(eos, dtype=np.int64) if ignore_eos and eos else None


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
    prog = SequenceProgress(backend, seq, n_predict, stats, stop)
    banned = banned_ids(backend, ignore_eos)
    while prog.has_room():
        if banned is not None:
            masked = logits.copy()
            masked[banned] = -np.inf
            token = sampler.sample(masked)
        else:
            token = sampler.sample(logits)
        delta = prog.accept(token)
        if delta is None:
            return
        yield TokenOut(token, delta, logits)
        if prog.context_full():
            return
        # every accepted token goes into the cache, so a chat can continue from it
        t = time.perf_counter()
        logits = backend.decode(seq, token)
        stats.next_logits = logits
        if prog.decoded(time.perf_counter() - t):
            return


def generate_batch(backend: Backend, seqs: list[Sequence], samplers: list[Sampler], n_predict: int,
                   stats: list[GenerationStats], logits: np.ndarray, stop: tuple[str, ...] = (),
                   ignore_eos: bool = False, entropy: bool = False,
                   on_token: Callable[[int, TokenOut], bool] | None = None) -> None:
    """Sample B sequences together, one :meth:`Backend.decode_batch` forward per token for all that are
    still running; each sequence's tokens, text and stop reason are those :func:`generate` gives it
    alone with the same sampler (up to the backend's batch-vs-single rounding of the logits).

    Each sequence has its own sampler (seeded stream), stream decoder, stop check and token count
    (the per-token logic is :func:`generate`'s own). A sequence that ends (EOS, ``n_predict``, a stop
    string, the context) or that ``on_token`` aborts leaves the batch before the next forward. Logits
    stay on the backend's device (``on_device=True``); per token only B ids, and with ``entropy`` B
    entropies, reach the host; a sequence's [vocab] row comes over once, when it ends
    (``stats[b].next_logits``).

    Args:
        backend: runs ``decode_batch``; seqs: B ≥ 1 distinct sequences, each already holding its context.
        samplers: B distinct samplers (one stream per sequence).
        n_predict: most tokens per sequence (tokens); < 0 means until EOS or the context is full.
        stats: B fresh :class:`GenerationStats`, filled in as generation proceeds (also on an exception).
        logits: [B, vocab] or [vocab] (shared by all) float32 next-token logits of the sequences as they stand.
        stop, ignore_eos: as :func:`generate`, for every sequence.
        entropy: compute each sampled row's entropy of softmax (nats) on the device: ``TokenOut.entropy``.
        on_token: called as ``on_token(b, tok)`` after each accepted token (``tok.logits`` is None);
            True aborts sequence b (stop reason ``aborted``; its token stays in ``stats`` but is not
            decoded into its cache). Exceptions it raises propagate, every sequence as it stands.
    Raises:
        ValueError: lengths of seqs, samplers and stats differ, or logits of the wrong shape.
    """
    import torch

    from .sampling import sample_batch

    B = len(seqs)
    if not B or len(samplers) != B or len(stats) != B:
        raise ValueError(f"generate_batch needs B >= 1 sequences with one sampler and one stats each, got "
                         f"{B}, {len(samplers)} and {len(stats)}")
    rows = torch.as_tensor(np.ascontiguousarray(logits, dtype=np.float32))
    rows = rows.expand(B, -1) if rows.dim() == 1 else rows
    if rows.shape[0] != B:
        raise ValueError(f"generate_batch needs [{B}, vocab] logits, got {tuple(rows.shape)}")
    progs = [SequenceProgress(backend, s, n_predict, st, stop) for s, st in zip(seqs, stats)]
    banned = banned_ids(backend, ignore_eos)
    banned_t = None if banned is None else torch.from_numpy(banned)
    active = list(range(B))

    def leave(b: int, row: torch.Tensor) -> None:
        stats[b].next_logits = row.float().cpu().numpy()

    while True:
        live = []
        for j, b in enumerate(active):
            if progs[b].has_room():
                live.append(j)
            else:
                leave(b, rows[j])
        if not live:
            return
        if len(live) < len(active):
            active = [active[j] for j in live]
            rows = rows[torch.tensor(live, device=rows.device)]
        sampled = rows
        if banned_t is not None:
            sampled = rows.clone()
            sampled[:, banned_t.to(rows.device)] = -torch.inf
        ids, ents = sample_batch(sampled, [samplers[b] for b in active], entropy=entropy)
        keep, tokens = [], []
        for j, b in enumerate(active):
            token = int(ids[j])
            delta = progs[b].accept(token)
            if delta is None:
                leave(b, rows[j])
                continue
            tok = TokenOut(token, delta, None, None if ents is None else float(ents[j]))
            if on_token is not None and on_token(b, tok):
                stats[b].stop_reason = "aborted"
                leave(b, rows[j])
                continue
            if progs[b].context_full():
                leave(b, rows[j])
                continue
            keep.append(b)
            tokens.append(token)
        if not keep:
            return
        active = keep
        t = time.perf_counter()
        rows = backend.decode_batch([seqs[b] for b in active], tokens, on_device=True)
        rows = torch.as_tensor(rows)
        dt = time.perf_counter() - t
        live = []
        for j, b in enumerate(active):
            if progs[b].decoded(dt):
                leave(b, rows[j])
            else:
                live.append(j)
        if len(live) < len(active):
            if not live:
                return
            active = [active[j] for j in live]
            rows = rows[torch.tensor(live, device=rows.device)]
