"""The full KV of one sequence in host memory: every position ever written, all layers.

ZoomR §3.4: the full cache lives in CPU memory and only the selected subset is moved to the compute
device. Storage per layer is one [Hkv, capacity, d] tensor for K and one for V; capacity doubles when
full, so appending costs amortized O(1) copies per token and no per-token reallocation. Keys are
stored post-RoPE at their original positions (positions are never shifted). Layout is
position-major, [capacity, Hkv, d], so the T positions of one forward are one contiguous block: a
device → host copy of them stays a single asynchronous copy.

On CUDA the buffers are pinned and new tokens are copied device → host with non-blocking copies on
a side stream; an event per layer says when the host copy is complete, and every host-side read of
that layer waits for it first.
"""

from __future__ import annotations

import torch


class HostKVStore:
    """Per-layer K/V of all positions, in host memory: ``k[layer]``/``v[layer]`` are [capacity, Hkv, d].

    Args:
        n_layers, n_kv_heads, head_dim: model shapes.
        dtype: storage dtype (the model's compute dtype).
        compute_device: where new K/V come from; CUDA turns on pinned buffers and async copies.
        capacity: positions reserved at first (tokens, ≥ 1).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 compute_device: torch.device, capacity: int = 256):
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.dtype = dtype
        self.cuda = compute_device.type == "cuda"
        self.k = [self._alloc(max(capacity, 1)) for _ in range(n_layers)]
        self.v = [self._alloc(max(capacity, 1)) for _ in range(n_layers)]
        self.n = [0] * n_layers            # positions written per layer (tokens)
        self._ready: list[torch.cuda.Event | None] = [None] * n_layers
        self._stream = torch.cuda.Stream(compute_device) if self.cuda else None

    def _alloc(self, cap: int) -> torch.Tensor:
        _, h, d = self.shape
        return torch.empty(cap, h, d, dtype=self.dtype, pin_memory=self.cuda)

    def sync(self, layer: int) -> None:
        """Wait until the host copy of ``layer``'s last append is complete (no-op on CPU)."""
        ev = self._ready[layer]
        if ev is not None:
            ev.synchronize()
            self._ready[layer] = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T new positions to ``layer``.

        Args:
            k, v: [Hkv, T, d] on the compute device.
        """
        T = k.shape[1]
        start, end = self.n[layer], self.n[layer] + T
        cap = self.k[layer].shape[0]
        if end > cap:
            self.sync(layer)
            new_cap = max(end, 2 * cap)
            for store in (self.k, self.v):
                grown = self._alloc(new_cap)
                grown[:start] = store[layer][:start]
                store[layer] = grown
        if self.cuda:
            cur = torch.cuda.current_stream(k.device)
            self._stream.wait_stream(cur)
            with torch.cuda.stream(self._stream):
                for src, dst in ((k, self.k[layer]), (v, self.v[layer])):
                    block = src.transpose(0, 1).contiguous()      # [T, Hkv, d], made on this stream
                    dst[start:end].copy_(block, non_blocking=True)
                    src.record_stream(self._stream)               # made on the compute stream, read here
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._ready[layer] = ev
        else:
            self.k[layer][start:end] = k.transpose(0, 1)
            self.v[layer][start:end] = v.transpose(0, 1)
        self.n[layer] = end

    def gather(self, layer: int, heads: torch.Tensor, positions: torch.Tensor,
               out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at (head, position) pairs of ``layer``, read on the host.

        Args:
            heads, positions: [M] int64 CPU tensors (KV head index, position).
            out_k, out_v: optional [M, d] host buffers to write into (pinned staging on CUDA).
        Returns:
            (K, V), each [M, d] host tensors.
        Raises:
            IndexError: a position not written yet.
        """
        self.sync(layer)
        if positions.numel() and int(positions.max()) >= self.n[layer]:
            raise IndexError(f"position {int(positions.max())} not written yet (layer {layer} has {self.n[layer]})")
        h, d = self.shape[1:]
        flat = positions * h + heads
        k = torch.index_select(self.k[layer].view(-1, d), 0, flat, out=out_k) if out_k is not None else \
            torch.index_select(self.k[layer].view(-1, d), 0, flat)
        v = torch.index_select(self.v[layer].view(-1, d), 0, flat, out=out_v) if out_v is not None else \
            torch.index_select(self.v[layer].view(-1, d), 0, flat)
        return k, v

    def keys(self, positions: torch.Tensor) -> torch.Tensor:
        """Keys of ``positions`` in every layer, as [L, Hkv, M, d] float32 (for mean keys)."""
        out = []
        for layer in range(self.shape[0]):
            self.sync(layer)
            out.append(self.k[layer][positions].transpose(0, 1).float())
        return torch.stack(out)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous views [n, Hkv, d] of all positions written in ``layer`` (after waiting for its copies)."""
        self.sync(layer)
        n = self.n[layer]
        return self.k[layer][:n], self.v[layer][:n]

    def allocated_bytes(self) -> int:
        """Bytes of the host K/V buffers allocated now (capacity, all layers)."""
        return sum(2 * t.numel() * t.element_size() for t in self.k)

    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        L, h, d = self.shape
        return 2 * L * h * d * torch.tensor([], dtype=self.dtype).element_size()

    def clone(self) -> "HostKVStore":
        """An independent copy holding the same positions (used by fork)."""
        L, h, d = self.shape
        other = HostKVStore.__new__(HostKVStore)
        other.shape, other.dtype, other.cuda = self.shape, self.dtype, self.cuda
        other.k, other.v = [], []
        for li in range(L):
            self.sync(li)
            n = self.n[li]
            for src, dst in ((self.k, other.k), (self.v, other.v)):
                t = other._alloc(src[li].shape[0])   # same reserve: a fork keeps growing like its source
                t[:n] = src[li][:n]
                dst.append(t)
        other.n = list(self.n)
        other._ready = [None] * L
        other._stream = self._stream
        return other
