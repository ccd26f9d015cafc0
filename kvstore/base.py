"""The KV-cache seam between the torch decoder and KV policies.

The decoder calls :meth:`KVCache.update` once per layer per forward with the new tokens' query,
key and value; the cache stores them and answers with the keys/values to attend. A policy
(eviction, ZoomR retrieval) is a KVCache that answers with a selection instead of everything.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .stats import KVMeter, KVStats, storage_bytes


def join_parts(parts: list) -> tuple[torch.Tensor, ...]:
    """Parts of a layer's attended set, each a tuple of tensors (K [Hkv, n_i, d], V [Hkv, n_i, d], maybe
    positions [Hkv, n_i]) in position order, as one tuple concatenated along positions (dim 1): the
    part itself when there is one (no copy), else fresh tensors (O(Σ n_i)); ``()`` for no parts.
    """
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(torch.cat(column, dim=1) for column in zip(*parts))


@runtime_checkable
class KVCache(Protocol):
    """Per-sequence KV storage for all layers.

    Attributes:
        n_tokens: positions written so far (tokens); the next token's position.
        needs_text: whether :meth:`end_forward` reads ``text`` (when False, callers may pass ``""`` and skip
            detokenizing every forward).
    """

    n_tokens: int
    needs_text: bool

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the T new tokens' K/V of ``layer`` and return what attention reads.

        Args:
            layer: layer index.
            q: [H, T, d] post-RoPE queries (policies may score with them).
            k: [Hkv, T, d] post-RoPE keys.
            v: [Hkv, T, d] values.
        Returns:
            (K, V), each [Hkv, N, d] with N ≥ T; the last T entries are the new tokens in order.
        """
        ...

    def end_forward(self, token_ids: list[int], text: str) -> None:
        """Called once after all layers ran for a forward of ``token_ids`` whose text is ``text``."""
        ...

    def fork(self) -> "KVCache":
        """An independent copy of this cache (same contents, separate future)."""
        ...

    def stats(self) -> KVStats:
        """Active/full token and byte counts (see :class:`zoomr.backends.base.KVStats`)."""
        ...


class FullKVCache:
    """Full KV on the compute device, no eviction: the reference every policy is compared with.

    Storage per layer: the K/V this cache wrote since its last fork, one [Hkv, capacity, d] buffer each
    (capacity doubles when full: amortized O(1) copies per token), after zero or more *frozen parts*:
    read-only [Hkv, n_i, d] views shared with the caches it forked from or into.

    A fork freezes what is written so far into a new part, for both sides, and each side appends to
    buffers of its own from then on: a family of forks that all decode holds their common prefix once
    (the prefix-sharing of vLLM's copy-on-write blocks or FlashInfer's cascade attention, at one part per
    fork generation). A fork itself copies no K/V; the side's own buffers are allocated at its first
    write. Attention reads the parts and the own buffer separately (:meth:`update_parts`; the decoder
    merges their softmax, see :meth:`zoomr.backends.torch.model.Decoder.forward_batch`); :meth:`update`
    answers one contiguous copy for callers that want one. After ``MAX_PARTS`` parts a fork first
    copies everything into one part (O(context), once per ``MAX_PARTS`` fork generations), so the
    per-layer work of attention stays bounded.

    Args:
        n_layers, n_kv_heads, head_dim: model shapes.
        device, dtype: where and how K/V are stored.
        capacity: initial positions reserved (tokens); a fork's own buffers start at ``FORK_CAPACITY``.
    """

    MAX_PARTS = 4
    FORK_CAPACITY = 16   # positions first reserved for a fork's own K/V (then doubling)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, capacity: int = 256):
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.device, self.dtype = device, dtype
        self._capacity = capacity
        self.k: list[torch.Tensor | None] = [None] * n_layers   # own buffers [Hkv, cap, d], None until written
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = [[] for _ in range(n_layers)]  # per layer, frozen
        self.frozen = 0      # positions held in the frozen parts (the same for every layer)
        self._device_bytes: int | None = None
        self.n_tokens = 0
        self.needs_text = False
        self.meter = KVMeter(self.token_bytes(), None, device.type)

    def _grow(self, layer: int, need: int) -> None:
        cur = self.k[layer]
        if cur is not None and need <= cur.shape[1]:
            return
        L, Hkv, d = self.shape
        # a fork's own buffers start small: a candidate of a few dozen tokens must not reserve a prompt's worth
        first = self._capacity if self.frozen == 0 else self.FORK_CAPACITY
        cap = max(need, first if cur is None else 2 * cur.shape[1])
        own = self.n_tokens - self.frozen
        self._device_bytes = None
        for store in (self.k, self.v):
            grown = torch.empty(Hkv, cap, d, device=self.device, dtype=self.dtype)
            if store[layer] is not None:
                grown[:, :own] = store[layer][:, :own]
            store[layer] = grown

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions in every layer's own buffers ``k[layer]``, ``v[layer]`` ([Hkv, capacity, d]),
        for a writer that stores the new tokens itself (:class:`zoomr.backends.torch.ggml_decode.DecodeGraph`)."""
        last = self.k[-1]
        if last is not None and n - self.frozen <= last.shape[1]:   # every step but a doubling: nothing to do
            return
        for layer in range(self.shape[0]):
            self._grow(layer, n - self.frozen)

    def update_parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Store the T new tokens of ``layer``; return what attention reads as parts in position order.

        Returns:
            [(K_i, V_i)], each [Hkv, n_i, d]: the frozen parts, then this cache's own positions with the
            T new tokens last. Σ n_i = positions written, the new ones included.
        """
        T = k.shape[1]
        own = self.n_tokens - self.frozen
        self._grow(layer, own + T)
        self.k[layer][:, own:own + T] = k
        self.v[layer][:, own:own + T] = v
        return [*self.parts[layer], (self.k[layer][:, :own + T], self.v[layer][:, :own + T])]

    def update(self, layer, q, k, v):
        """See :meth:`KVCache.update`; returns all positions written so far (one contiguous copy when the
        cache holds frozen parts)."""
        return join_parts(self.update_parts(layer, q, k, v))

    def end_forward(self, token_ids, text):
        """Advance the write position by the forward's token count."""
        is_prompt = self.n_tokens == 0
        self.n_tokens += len(token_ids)
        b = self.token_bytes()
        self.meter.step(self.n_tokens, self.n_tokens * b, self.n_tokens, is_prompt, device_bytes=self.device_bytes())

    def _freeze(self) -> None:
        """Turn this cache's own positions into a frozen part (merging all parts into one past MAX_PARTS)."""
        own = self.n_tokens - self.frozen
        for layer in range(self.shape[0]):
            parts = self.parts[layer]
            if own:
                parts = [*parts, (self.k[layer][:, :own], self.v[layer][:, :own])]
            if len(parts) > self.MAX_PARTS:
                parts = [join_parts(parts)]
            self.parts[layer] = parts
            self.k[layer] = self.v[layer] = None
        self.frozen = self.n_tokens
        self._device_bytes = None

    def fork(self):
        """A cache holding the same positions; both sides share them, frozen, and append to their own buffers."""
        return self._fork_as(FullKVCache)

    def scoring_fork(self) -> "ScoringKVCache":
        """A fork for one teacher-forced forward that keeps none of its new K/V (see :class:`ScoringKVCache`)."""
        other = self._fork_as(ScoringKVCache)
        other.spent = False
        return other

    def _fork_as(self, cls):
        # after the freeze every position sits in the shared parts and the own buffers are empty (None)
        self._freeze()
        other = cls.__new__(cls)
        other.__dict__.update(self.__dict__)
        other.k, other.v = list(self.k), list(self.v)
        other.parts = [list(p) for p in self.parts]
        other.meter = self.meter.copy()
        return other

    def storages(self):
        """``("device", tensor)`` for every K/V buffer held, shared parts included (see
        :func:`zoomr.kvstore.stats.distinct_kv_bytes`)."""
        for layer in range(self.shape[0]):
            for K, V in self.parts[layer]:
                yield "device", K
                yield "device", V
            for t in (self.k[layer], self.v[layer]):
                if t is not None:
                    yield "device", t

    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        L, Hkv, d = self.shape
        return 2 * L * Hkv * d * torch.tensor([], dtype=self.dtype).element_size()

    def device_bytes(self) -> int:
        """Bytes of the K/V buffers this cache reads on the device now: its own (capacity) and the frozen
        parts' storages (shared ones included), all layers."""
        if self._device_bytes is None:   # recounted only after a buffer changed, not every forward
            self._device_bytes = storage_bytes(t for _, t in self.storages())
        return self._device_bytes

    def stats(self) -> KVStats:
        """Active == full for this cache; everything sits on the compute device, nothing on the host."""
        return self.meter.stats(self.n_tokens, self.n_tokens, self.n_tokens * self.token_bytes())


class ScoringKVCache(FullKVCache):
    """A fork of a :class:`FullKVCache` that serves one teacher-forced forward (scoring a candidate's
    tokens) and stores none of them: each layer attends the parent's frozen positions plus the forward's
    own new K/V, which are dropped once the layer is done. Scoring B candidates over a shared context thus
    holds no K/V beyond the context and one layer's new tokens, instead of B forks' buffers (vLLM's
    prompt-logprob pass over a shared prefix, at the granularity of one forward).

    Made by :meth:`FullKVCache.scoring_fork`; after its forward it refuses another.

    Raises:
        RuntimeError: a second forward through the same scoring fork.
    """

    def update_parts(self, layer, q, k, v):
        """The parent's parts, then the T new tokens ([Hkv, T, d] views, not stored)."""
        if self.spent:
            raise RuntimeError("a scoring fork serves one forward; fork again for another")
        return [*self.parts[layer], (k, v)]

    def end_forward(self, token_ids, text):
        """Count the forward's tokens; nothing of them is held, so no further forward may follow."""
        self.n_tokens += len(token_ids)
        self.spent = True

    def fork(self):
        raise RuntimeError("a scoring fork cannot be forked (it holds only its parent's positions)")

