"""One model's view of the KV-Rescue trajectory: its committed KV state, forks for candidates, re-base.

Source: KV-Rescue (arXiv:2608.15797), "Stepwise interleaving" and "Best-of-(N+N) trajectory": both
models follow one committed trajectory c_t = (question, s_<t) but hold different views of it — the
base an evicted cache, the helper the full one. After a commit, the winner's fork *becomes* its
model's state (no token of the history is computed again) and the other model prefills only the
committed step's tokens; an evicting base then evicts back to its budget by its own policy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from zoomr.backends.base import Backend, Sequence, Tokenizer

# Text that exercises digits, LaTeX, spaces, paragraph breaks and non-ASCII: two tokenizers that agree
# on it and on the vocabulary size are taken to be the same tokenizer (Qwen2.5-Math 7B / 1.5B are).
_PROBE = "Step 1: 16 - 3 - 4 = 9, so $\\frac{9}{2} \\times 2$ = 9.\n\nThe answer is \\boxed{18}. Ünïcødé 数学"


@functools.lru_cache(maxsize=16)  # tokenizers live as long as the run; the probe is encoded once per pair
def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """True when token ids can cross between the two models unchanged."""
    return a is b or (a.vocab_size == b.vocab_size and a.encode(_PROBE) == b.encode(_PROBE))


@dataclass
class Candidate:
    """One sampled step.

    Attributes:
        step, index: step number and candidate number within it.
        source: ``base`` or ``helper``.
        engine: the :class:`Engine` that sampled it.
        seq: its fork (None once freed).
        ids: sampled ids in the source model's tokens (EOS excluded).
        text: their text.
        stop_reason: see :class:`zoomr.rescue.events.CandidateFinished`.
        next_logits: [vocab] next-token logits of ``seq`` after the last token.
        score: the scorer's value, once scored.
    """

    step: int
    index: int
    source: str
    engine: "Engine"
    seq: Sequence | None
    ids: list[int]
    text: str
    stop_reason: str
    next_logits: np.ndarray | None
    score: float = float("nan")

    @property
    def final(self) -> bool:
        """The step ended the solution (its model emitted EOS)."""
        return self.stop_reason == "eos"


class Engine:
    """A backend plus the committed state of one role (``base`` or ``helper``).

    Counters (tokens): ``generated`` (sampled by this role's candidates, winners or not),
    ``prefilled`` (prompt + other roles' committed steps), ``length`` (committed trajectory in this
    model's tokens: what full KV would hold).

    Args:
        role: ``base`` or ``helper``.
        backend: the model runtime, already configured with the role's KV policy.
    """

    def __init__(self, role: str, backend: Backend):
        self.role, self.backend = role, backend
        self.seq: Sequence | None = None
        self.next_logits: np.ndarray | None = None
        self.length = self.generated = self.prefilled = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.backend.tokenizer

    def start(self, prompt_ids: list[int]) -> None:
        """Prefill the prompt into a fresh sequence.

        Raises:
            ValueError: the prompt does not fit the backend's context.
        """
        self.seq = self.backend.new_sequence()
        self.extend(prompt_ids)

    def fork(self) -> Sequence:
        """A candidate's sequence, sharing the committed state (nothing is decoded again)."""
        return self.backend.fork(self.seq)

    def scoring_fork(self) -> Sequence:
        """A fork of the committed state for one scoring forward; on a backend that can, it keeps none of
        the scored tokens' K/V (``scoring_fork``), else a plain :meth:`fork`."""
        make = getattr(self.backend, "scoring_fork", None)
        return make(self.seq) if make is not None else self.backend.fork(self.seq)

    def release(self, seq: Sequence | None) -> None:
        """Free a candidate's fork (None is ignored)."""
        if seq is not None:
            self.backend.free(seq)

    def adopt(self, cand: Candidate) -> None:
        """Re-base on this role's own winning candidate: its fork becomes the committed state."""
        self.release(self.seq)
        self.seq, self.next_logits = cand.seq, cand.next_logits
        cand.seq = None
        self.length += len(cand.ids)

    def extend(self, ids: list[int]) -> int:
        """Re-base on another role's step: prefill ``ids`` into the committed state (an evicting policy
        evicts back to its budget as it goes). Returns the tokens prefilled (0 for an empty step)."""
        if ids:
            self.next_logits = self.backend.prefill(self.seq, ids)
            self.length += len(ids)
            self.prefilled += len(ids)
        return len(ids)

    def ids_of(self, cand: Candidate) -> list[int]:
        """``cand``'s tokens in this model's vocabulary: its own ids when the tokenizers agree, else its
        text encoded by this model (control tokens not parsed: text from another model stays text)."""
        if cand.engine is self or same_tokenizer(cand.engine.tokenizer, self.tokenizer):
            return list(cand.ids)
        return self.tokenizer.encode(cand.text, special=False) if cand.text else []

    def close(self) -> None:
        """Free the committed state."""
        self.release(self.seq)
        self.seq = None
