"""Eviction decisions of one policy on the torch and llama.cpp backends over the same tokens, side by side.

Both backends are fed the same token ids (a prompt, then teacher-forced continuation tokens one decode step at
a time), so their decisions can differ only where their arithmetic does (llama.cpp's quantized dot products
and f16 cache against torch's fp32). After each step the positions each backend keeps are read: llama.cpp's
resident cells (``seq.origin``) and the torch cache's attended positions (KV head 0 of layer 0, the same for
every head and layer under ``--selection shared``). A step is an *eviction* when either side dropped
positions; a decision is *identical* when both dropped exactly the same ones. Policies that cut many positions
at once (SnapKV, R-KV and KeyDiff drop their 128-token buffer each time) are also counted per position: of the
positions either side evicted at a step, the share both evicted, since one near-tied pair swapped at the
boundary of a 128-position cut makes the whole decision differ.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionAgreement:
    """Decisions compared over one token stream.

    Attributes:
        evictions: steps at which either backend evicted something.
        identical: those at which both evicted exactly the same positions.
        positions: positions evicted by either backend, summed over those steps (tokens).
        agreed: of those, the positions both evicted at the same step (tokens).
    """

    evictions: int
    identical: int
    positions: int = 0
    agreed: int = 0

    @property
    def share(self) -> float:
        """identical / evictions (1.0 when nothing was evicted)."""
        return self.identical / self.evictions if self.evictions else 1.0

    @property
    def position_share(self) -> float:
        """agreed / positions (1.0 when nothing was evicted)."""
        return self.agreed / self.positions if self.positions else 1.0


def _evicted(before: set[int], new: int, after: set[int]) -> frozenset[int]:
    return frozenset((before | {new}) - after)


def compare_evictions(torch_backend, llama_backend, prompt: list[int], continuation: list[int]
                      ) -> EvictionAgreement:
    """Run ``prompt`` then each ``continuation`` token through both backends and compare their evictions.

    Args:
        torch_backend: a :class:`zoomr.backends.torch.engine.TorchBackend` whose sequences run the policy with
            ``selection="shared"``.
        llama_backend: a :class:`zoomr.backends.llamacpp.engine.LlamaCppBackend` running the same policy.
        prompt: token ids prefilled first; continuation: ids decoded one step each (e.g. llama.cpp's greedy text).
    Returns:
        the decisions counted over the continuation's steps.
    """
    ts, ls = torch_backend.new_sequence(), llama_backend.new_sequence()
    try:
        torch_backend.prefill(ts, prompt)
        llama_backend.prefill(ls, prompt)
        t_before = _torch_kept(ts)   # the prompt's cut: llama.cpp makes it in prefill, torch at the next forward
        l_before = set(ls.origin)
        evictions = identical = positions = agreed = 0
        for tok in continuation:
            new = len(ts.tokens)
            llama_backend.decode(ls, tok)
            torch_backend.decode(ts, tok)
            l_after = set(ls.origin)
            t_after = _torch_kept(ts)
            a, b = _evicted(t_before, new, t_after), _evicted(l_before, new, l_after)
            if a or b:
                evictions += 1
                identical += a == b
                positions, agreed = positions + len(a | b), agreed + len(a & b)
            t_before, l_before = t_after, l_after
        return EvictionAgreement(evictions, identical, positions, agreed)
    finally:
        torch_backend.free(ts)
        llama_backend.free(ls)


def _torch_kept(seq) -> set[int]:
    """Positions the torch cache keeps after its last forward: the selection scheduled for its next forward
    when the policy chose one, else everything the last forward attended."""
    cache = seq.cache
    pending = getattr(cache.active, "pending", [None])[0]
    kept = cache.positions(0) if pending is None else pending
    return set(kept[0].tolist())
