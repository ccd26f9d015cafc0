"""The KV-cache seam between the torch decoder and KV policies.

The decoder calls :meth:`KVCache.update` once per layer per forward with the new tokens' query,
key and value; the cache stores them and answers with the keys/values to attend. A policy
(eviction, ZoomR retrieval) is a KVCache that answers with a selection instead of everything.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .stats import KVMeter, KVStats


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

    Storage per layer is [Hkv, capacity, d] for K and V; capacity doubles when full, so appending
    costs amortized O(1) copies per token (no per-token reallocation).

    A fork shares the buffers (copy-on-write): storage is append-only and each side reads only its
    first ``n_tokens`` positions, so the first side to append after the fork writes in place; a side
    that finds the other already wrote past its end copies its positions of that layer into fresh
    buffers first (O(context), paid at its first forward, not at the fork). Attention here reads one
    contiguous [Hkv, N, d] tensor, so two sides that both decode do end up with a copy each; sharing
    the prefix during decoding needs attention that reads the prefix and each side's tail separately.

    Args:
        n_layers, n_kv_heads, head_dim: model shapes.
        device, dtype: where and how K/V are stored.
        capacity: initial positions reserved (tokens).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, capacity: int = 256):
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.device, self.dtype = device, dtype
        self.k = [torch.empty(n_kv_heads, capacity, head_dim, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.empty_like(x) for x in self.k]
        self._end = [[0] for _ in range(n_layers)]   # per layer: positions written into the buffers by
        #                                              any fork sharing them (one list object per buffer)
        self.n_tokens = 0
        self.needs_text = False
        self.meter = KVMeter(self.token_bytes(), None, device.type)

    def _grow(self, layer: int, need: int) -> None:
        cap = self.k[layer].shape[1]
        mine = self._end[layer][0] == self.n_tokens
        if need <= cap and mine:
            return
        new_cap = max(need, 2 * cap) if need > cap else cap
        for store in (self.k, self.v):
            old = store[layer]
            grown = torch.empty(old.shape[0], new_cap, old.shape[2], device=old.device, dtype=old.dtype)
            grown[:, :self.n_tokens] = old[:, :self.n_tokens]
            store[layer] = grown
        self._end[layer] = [self.n_tokens]

    def update(self, layer, q, k, v):
        """See :meth:`KVCache.update`; returns all positions written so far."""
        T = k.shape[1]
        end = self.n_tokens + T
        self._grow(layer, end)
        self.k[layer][:, self.n_tokens:end] = k
        self.v[layer][:, self.n_tokens:end] = v
        self._end[layer][0] = end
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def end_forward(self, token_ids, text):
        """Advance the write position by the forward's token count."""
        is_prompt = self.n_tokens == 0
        self.n_tokens += len(token_ids)
        b = self.token_bytes()
        self.meter.step(self.n_tokens, self.n_tokens * b, self.n_tokens, is_prompt, device_bytes=self.device_bytes())

    def fork(self):
        """A cache holding the same positions, sharing the buffers until one side must copy (see above)."""
        other = FullKVCache.__new__(FullKVCache)
        other.shape, other.device, other.dtype = self.shape, self.device, self.dtype
        other.k, other.v, other._end = list(self.k), list(self.v), list(self._end)
        other.n_tokens, other.meter = self.n_tokens, self.meter.copy()
        return other

    def storages(self):
        """``("device", tensor)`` for every K/V buffer held (see :func:`zoomr.kvstore.stats.distinct_kv_bytes`)."""
        for t in (*self.k, *self.v):
            yield "device", t

    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        L, Hkv, d = self.shape
        return 2 * L * Hkv * d * torch.tensor([], dtype=self.dtype).element_size()

    def device_bytes(self) -> int:
        """Bytes of the K/V buffers allocated on the device now (capacity, all layers)."""
        return sum(2 * t.numel() * t.element_size() for t in self.k)

    def stats(self) -> KVStats:
        """Active == full for this cache; everything sits on the compute device, nothing on the host."""
        return self.meter.stats(self.n_tokens, self.n_tokens, self.n_tokens * self.token_bytes())
