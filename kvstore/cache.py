"""A :class:`zoomr.kvstore.base.KVCache` driven by a :class:`zoomr.kvstore.policy.KVPolicy`, offloaded to host memory.

Per layer and forward: the new K/V go to the host store (all positions, ZoomR §3.4), the active set
(the policy's last selection + tokens appended since) is attended, and the policy observes the
queries and attended keys. After the forward the policy may answer with a new selection, which the
active set applies before that layer's next forward (on CUDA, prefetched one layer ahead).

Positions are never shifted: every key keeps the RoPE rotation of its original position, and the
next token's position is :attr:`PolicyKVCache.n_tokens` (positions written), whatever was evicted.
"""

from __future__ import annotations

import copy

import torch

from .active_set import ResidentActiveSet, StreamedActiveSet
from .base import join_parts
from .events import EventBus
from .host_store import BLOCK, HostKVStore, PositionCount
from .policy import ForwardInfo, KVPolicy, LayerView, PolicyContext
from .stats import KVMeter, KVStats, storage_bytes

OFFLOAD_MODES = ("resident", "stream")
STREAM_BLOCK = 512   # host-store block of a streamed cache (positions)


class PolicyKVCache:
    """KV cache of one sequence: host store + device active set + a policy.

    The host store holds every position only when the policy may restore one it dropped
    (``policy.restores_evicted``: SumR, ZoomR) or the cache streams full KV from the host; otherwise it
    just counts positions (:class:`zoomr.kvstore.host_store.PositionCount`).

    Args:
        policy: a fresh policy (one per cache).
        n_layers, n_heads, n_kv_heads, head_dim: model shapes.
        device, dtype: compute device and K/V dtype.
        offload: ``resident`` (selected K/V stay on the device; moves only what changed) or ``stream``
            (every layer copied from the host each step; the full policy only).
        events: bus the policy's recompute events go to (None: dropped).
        block: positions per host-store block (see :mod:`zoomr.kvstore.host_store`); None: 64 when
            resident (a fork copies < 64 positions per layer), 512 when streamed (each step copies every
            block to the device, so fewer, larger copies).
    Raises:
        ValueError: unknown offload mode, or ``stream`` with a policy that selects.

    Attributes:
        n_tokens: positions written (tokens); the next token's position.
    """

    def __init__(self, policy: KVPolicy, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, offload: str = "resident",
                 events: EventBus | None = None, block: int | None = None):
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload {offload!r} unknown (choose from {', '.join(OFFLOAD_MODES)})")
        if offload == "stream" and policy.evicts:
            raise ValueError(f"offload 'stream' copies every position each step; policy {policy.name} selects")
        self.policy, self.device, self.dtype, self.offload = policy, device, dtype, offload
        self.needs_text = policy.needs_text
        self.events = events
        if block is None:
            block = BLOCK if offload == "resident" else STREAM_BLOCK
        if offload == "stream" or policy.restores_evicted:
            self.store = HostKVStore(n_layers, n_kv_heads, head_dim, dtype, device, block)
        else:  # nothing it dropped comes back: no host copy (R-KV/H2O/StreamingLLM hold only what they keep)
            self.store = PositionCount(n_layers, n_kv_heads, head_dim, dtype)
        active_cls = ResidentActiveSet if offload == "resident" else StreamedActiveSet
        self.active = active_cls(self.store, device, dtype)
        self.ctx = PolicyContext(n_layers, n_heads, n_kv_heads, head_dim, device, self.store, self._emit)
        policy.bind(self.ctx)
        self.n_tokens = 0
        self._attended = [0] * n_layers     # positions attended per layer at the last forward
        self._layer_bytes = self.store.token_bytes() // n_layers
        self.meter = KVMeter(self.store.token_bytes(), policy.bound_tokens, device.type)
        self._pos_new = torch.empty(0, dtype=torch.long)   # positions of this forward's tokens
        self._streamed_peak = 0   # stream: most device K/V bytes held while a layer attended, this forward

    def _emit(self, event) -> None:
        if self.events is not None:
            self.events.emit(event)

    def update_parts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Store the T new tokens of ``layer``; return the active set's K/V as parts in position order.

        Args:
            q: [H, T, d] post-RoPE queries; k, v: [Hkv, T, d] (see :meth:`zoomr.kvstore.base.KVCache.update`).
        Returns:
            [(K_i, V_i)], each [Hkv, n_i, d] on the device: the frozen parts a fork shares, then this
            cache's own positions with the T new tokens last (a single part when nothing is shared). Read
            them in place (:func:`zoomr.backends.torch.model.attend_parts`), never write them.
        """
        T = k.shape[1]
        if layer == 0 or self._pos_new.shape[0] != T:
            self._pos_new = torch.arange(self.n_tokens, self.n_tokens + T)
        pos_new = self._pos_new
        self.store.append(layer, k, v)
        parts = self.active.attend_parts(layer, k, v, pos_new)
        self._attended[layer] = sum(K.shape[1] for K, _, _ in parts)
        if self.offload == "stream":
            # what attention reads is a copy made for this layer (freed after it) beside the next layer's
            # prefetch: after the forward nothing is left to count, so the peak is taken here
            held = storage_bytes(t for K, V, _ in parts for t in (K, V)) + self.active.device_bytes()
            self._streamed_peak = max(self._streamed_peak, held)
        # the policy sees the parts; keys/positions are concatenated only if it reads them whole
        view = LayerView(layer, q, [K for K, _, _ in parts], [p for _, _, p in parts], T, self.n_tokens)
        selection = self.policy.observe(view)
        if selection is not None:
            self.active.schedule(layer, selection)
        return [(K, V) for K, V, _ in parts]

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`zoomr.kvstore.base.KVCache.update`: returns the active set's K/V, new tokens last
        (one contiguous copy when a fork shares frozen parts; :meth:`update_parts` reads them in place)."""
        return join_parts(self.update_parts(layer, q, k, v))

    def end_forward(self, token_ids: list[int], text: str) -> None:
        """Advance positions, account the active size, let the policy choose the next selection."""
        fwd = ForwardInfo(self.n_tokens, list(token_ids), text, self.n_tokens == 0)
        self.n_tokens = fwd.end
        selection = self.policy.end_forward(fwd)
        # a bound may depend on the prompt (R-KV attends it whole until its first compression): known now
        self.meter.bound = self.policy.bound_tokens
        device_bytes = max(self.active.device_bytes(), self._streamed_peak)
        self._streamed_peak = 0
        # the policy's state is read after its end_forward, which may add to it (ZoomR's mean keys)
        self.meter.step(max(self._attended), sum(self._attended) * self._layer_bytes, self.n_tokens, fwd.is_prompt,
                        device_bytes=device_bytes, host_bytes=self.store.allocated_bytes(),
                        state_bytes=self.policy.state_bytes())
        if selection is not None:
            for layer in range(self.ctx.n_layers):
                self.active.schedule(layer, selection)
        self.active.prefetch(0)

    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, N] positions ``layer`` attended at its last forward (CPU int64)."""
        return self.active.positions(layer)

    def fork(self) -> "PolicyKVCache":
        """A cache with the same contents and a separate future; events go to the same bus.

        Shares what is stored: the host store's sealed blocks (its tails, < ``block`` positions per
        layer, are copied), the active set's resident K/V (frozen into read-only parts both sides attend
        in place; each appends to small buffers of its own, see
        :class:`zoomr.kvstore.active_set.ResidentActiveSet`) and whatever the policy holds immutably
        (:meth:`zoomr.kvstore.policy.KVPolicy.fork` says what each policy copies). Neither side ever
        sees the other's later tokens or selections.
        """
        other = copy.copy(self)
        other.store = self.store.fork()
        other.active = self.active.fork(other.store)
        other.ctx = PolicyContext(self.ctx.n_layers, self.ctx.n_heads, self.ctx.n_kv_heads, self.ctx.head_dim,
                                  self.device, other.store, other._emit)
        other.policy = self.policy.fork(other.ctx)
        other._attended = list(self._attended)
        other.meter = self.meter.copy()
        return other

    def storages(self):
        """``(where, tensor)`` for every K/V buffer held: ``host`` store blocks and tails, ``device``
        active-set buffers (see :func:`zoomr.kvstore.stats.distinct_kv_bytes`)."""
        for t in self.store.buffers():
            yield "host", t
        for t in self.active.buffers():
            yield "device", t

    def stats(self) -> KVStats:
        """Active = positions attended at the last forward (max over layers; bytes summed over layers).

        Means, peaks and allocations come from the cache's :class:`zoomr.backends.base.KVMeter`; ``extra``
        holds: ``policy`` (its description), ``moved_tokens`` (positions copied host → device by
        selections, per KV head) and the policy's own numbers (recomputes, AG mean/std, summaries mode ...).
        """
        h = self.store.shape[1]
        extra = {"policy": self.policy.describe(), "moved_tokens": self.active.moved_pairs // h, **self.policy.stats()}
        return self.meter.stats(max(self._attended), self.n_tokens, sum(self._attended) * self._layer_bytes, extra)
