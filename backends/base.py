"""The backend seam: what every model runtime (torch, llama.cpp) offers to zoomr.

A backend owns model weights and a tokenizer and runs *sequences*: independent KV caches that
can be prefilled, decoded one token at a time, forked (a candidate branching from a committed
prefix, KV-Rescue) and freed. Logits cross the seam as float32 numpy arrays so the sampler, the
generation loop and the rescue loop are backend-neutral.

Terms follow vLLM / llama.cpp: prefill (many prompt tokens in one forward), decode (one token),
KV cache, budget (KV tokens a policy may keep resident), fork, eviction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import numpy as np

# KV accounting lives with the KV caches; re-exported here because every backend reports it
from zoomr.kvstore.stats import KVMeter, KVStats  # noqa: F401


def check_batch(seqs: list, ids_list: list[list[int]]) -> None:
    """The shape rules every backend's batched prefill/decode share: B ≥ 1 distinct sequences, one id list
    each (per-sequence checks, ids and context, are the backend's).

    Raises:
        ValueError: one line: an empty batch, counts that differ, a sequence twice.
    """
    if not seqs:
        raise ValueError("a batch needs at least one sequence")
    if len(seqs) != len(ids_list):
        raise ValueError(f"a batch needs one id list per sequence, got {len(seqs)} sequences and "
                         f"{len(ids_list)} id lists")
    if len({id(s) for s in seqs}) != len(seqs):
        raise ValueError("a sequence appears twice in one batch")


class BackendError(RuntimeError):
    """A model runtime failed on well-formed input (for example llama.cpp found no KV slot)."""


@dataclass(frozen=True)
class ControlToken:
    """A token that only special-token parsing makes from its text (``<|im_start|>``, ``<|im_end|>``).

    Attributes:
        id: its token id.
        lstrip / rstrip: parsing it also swallows the whitespace before / after it (llama.cpp's
            LSTRIP/RSTRIP token attributes, HF ``AddedToken.lstrip``/``rstrip``).
    """

    id: int
    lstrip: bool = False
    rstrip: bool = False


@runtime_checkable
class Tokenizer(Protocol):
    """A model's own tokenizer.

    Attributes:
        vocab_size: number of token ids (logit width).
        bos_id: id of the beginning-of-sequence token, or None.
        eos_ids: ids that end generation (EOS, end-of-turn).
        chat_template: the model's Jinja chat template, or None when the model has none.
        bos_text / eos_text: the special tokens' text, for templates.
        control_tokens: text → :class:`ControlToken` for every token that ``special=True`` parses and
            ``special=False`` leaves as plain text.
        adds_bos: the tokenizer's configuration puts BOS in front of a sequence (GGUF
            ``tokenizer.ggml.add_bos_token``; HF ``add_bos_token`` or the post-processor).
    """

    vocab_size: int
    bos_id: int | None
    eos_ids: frozenset[int]
    chat_template: str | None
    bos_text: str
    eos_text: str
    control_tokens: Mapping[str, ControlToken]
    adds_bos: bool

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``special`` parses the text of control tokens (``<|im_start|>``) into their ids; without it that
        text is tokenized like any other. ``add_bos`` adds what the tokenizer's configuration adds around
        a sequence (BOS when :attr:`adds_bos`, EOS when it says so too), as llama.cpp's ``add_special``.
        Lone surrogates in ``text`` are tokenized as U+FFFD.
        """
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 at the edges becomes U+FFFD)."""
        ...


@runtime_checkable
class Sequence(Protocol):
    """One KV cache inside a backend. ``tokens`` are the ids whose KV it holds, in order."""

    tokens: list[int]


@runtime_checkable
class Backend(Protocol):
    """A model runtime. All logits are float32 numpy arrays over the vocabulary.

    Errors: methods raise :class:`BackendError` when the runtime fails, ``ValueError`` on ids
    outside the vocabulary or a context overflow.
    """

    name: str
    tokenizer: Tokenizer
    n_ctx: int

    def new_sequence(self) -> Sequence:
        """An empty sequence with the backend's configured KV policy."""
        ...

    def prefill(self, seq: Sequence, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Append ``ids`` (len T ≥ 1) to ``seq`` in one forward.

        Returns logits of the last position, shape [vocab], or of every position, shape [T, vocab],
        when ``all_logits``.
        """
        ...

    def decode(self, seq: Sequence, token: int) -> np.ndarray:
        """Append one token; returns next-token logits, shape [vocab]."""
        ...

    def prefill_batch(self, seqs: list[Sequence], ids_list: list[list[int]], all_logits: bool = False
                      ) -> np.ndarray | list[np.ndarray]:
        """Append ``ids_list[b]`` (ragged lengths, each ≥ 1) to ``seqs[b]`` for B ≥ 1 distinct sequences,
        batched where the runtime can (each sequence keeps its own KV policy).

        Returns logits [B, vocab] of each sequence's last position, or a list of B arrays [T_b, vocab]
        with ``all_logits``. Raises ValueError (one line) on an empty batch, lengths that differ, a
        repeated sequence, an empty id list, or the errors of :meth:`prefill`, before any sequence advances.
        """
        ...

    def decode_batch(self, seqs: list[Sequence], tokens: list[int], on_device: bool = False):
        """Append ``tokens[b]`` to ``seqs[b]`` for B ≥ 1 distinct sequences in one forward.

        Returns next-token logits [B, vocab]: float32 numpy, or with ``on_device`` whatever array the
        runtime holds them in (a torch tensor on the torch backend's device), ready for
        :func:`zoomr.backends.sampling.sample_batch`. Raises as :meth:`prefill_batch`.
        """
        ...

    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence sharing ``seq``'s state; the prefix is never decoded again."""
        ...

    def free(self, seq: Sequence) -> None:
        """Release the KV cache of ``seq``."""
        ...

    def kv_stats(self, seq: Sequence) -> KVStats:
        """KV accounting of ``seq`` (see :class:`KVStats`)."""
        ...

    def describe(self) -> str:
        """One line naming the model, device, dtype and policy."""
        ...
