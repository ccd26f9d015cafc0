"""The full KV of one sequence in host memory: every position ever written, all layers.

ZoomR §3.4: the full cache lives in CPU memory and only the selected subset is moved to the compute
device. Keys are stored post-RoPE at their original positions (positions are never shifted).

Layout: per layer, a list of *sealed blocks* of ``block`` positions each plus one *tail* block being
filled, each block [block, Hkv, d] (position-major, so a run of positions is one contiguous piece).
A block is sealed when its last position is written and is never written again. That is what makes
:meth:`HostKVStore.fork` cheap: a fork references the parent's sealed blocks (a list of pointers,
``L · n / block`` of them) and copies only the tail (< ``block`` positions per layer); from then on each
side writes only its own tail, so neither can see the other's new tokens. Sealed blocks are freed
when the last store referencing them is (Python reference counting). On the CPU the tail's capacity doubles
up to one block (a fork's copy is as big as the parent's tail, at most twice its use); appending costs amortized O(1) copies per
position, no per-token reallocation.

On CUDA the blocks are pinned and new tokens are copied device → host with non-blocking copies on
a side stream; an event per layer says when the host copy is complete, and every host-side read of
that layer (gather, keys, chunks, fork) waits for it first.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 64   # positions per block: a fork copies < BLOCK positions per layer; gathers loop over blocks


class HostKVStore:
    """Per-layer K/V of all positions, in host memory, as sealed blocks + a tail (see the module doc).

    Args:
        n_layers, n_kv_heads, head_dim: model shapes.
        dtype: storage dtype (the model's compute dtype).
        compute_device: where new K/V come from; CUDA turns on pinned buffers and async copies.
        block: positions per block (≥ 1).
    Raises:
        ValueError: block < 1.

    Attributes:
        n: positions written per layer (tokens).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 compute_device: torch.device, block: int = BLOCK):
        if block < 1:
            raise ValueError(f"block must be at least 1 position, got {block}")
        self.shape = (n_layers, n_kv_heads, head_dim)
        self.dtype, self.block = dtype, block
        self.cuda = compute_device.type == "cuda"
        self.sealed_k: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]   # [block, Hkv, d] each
        self.sealed_v: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        self.tail_k: list[torch.Tensor | None] = [None] * n_layers               # [≤ block, Hkv, d], owned
        self.tail_v: list[torch.Tensor | None] = [None] * n_layers
        self.n = [0] * n_layers
        self._bytes = 0                    # K+V bytes of the blocks held (kept, so accounting per forward is O(1))
        self._ready: list[torch.cuda.Event | None] = [None] * n_layers
        self._stream = torch.cuda.Stream(compute_device) if self.cuda else None

    def _alloc(self, rows: int) -> torch.Tensor:
        _, h, d = self.shape
        return torch.empty(rows, h, d, dtype=self.dtype, pin_memory=self.cuda)

    def _reserve(self, layer: int, used: int, need: int) -> None:
        # the tail grows by doubling up to one block (CPU), so a fork's copy of it is about its use
        cap = 0 if self.tail_k[layer] is None else self.tail_k[layer].shape[0]
        if need <= cap:
            return
        # on CUDA a whole block at once: growing would copy on the host while the side stream may still
        # be writing into the old tail, which needs a host wait per growth
        rows = self.block if self.cuda else min(self.block, max(need, 2 * cap, 16))
        for tails in (self.tail_k, self.tail_v):
            t = self._alloc(rows)
            self._bytes += t.numel() * t.element_size() - (0 if tails[layer] is None else
                                                           tails[layer].numel() * tails[layer].element_size())
            if used:
                t[:used] = tails[layer][:used]
            tails[layer] = t

    def sync(self, layer: int) -> None:
        """Wait until the host copy of ``layer``'s last append is complete (no-op on CPU)."""
        ev = self._ready[layer]
        if ev is not None:
            ev.synchronize()
            self._ready[layer] = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append T new positions to ``layer`` (into its tail; full tails are sealed).

        Args:
            k, v: [Hkv, T, d] on the compute device.
        """
        T = k.shape[1]
        if self.cuda:
            cur = torch.cuda.current_stream(k.device)
            self._stream.wait_stream(cur)
            with torch.cuda.stream(self._stream):
                self._write(layer, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), True)
                k.record_stream(self._stream)      # made on the compute stream, read here
                v.record_stream(self._stream)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._ready[layer] = ev
        else:
            self._write(layer, k.transpose(0, 1), v.transpose(0, 1), False)
        self.n[layer] += T

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, non_blocking: bool) -> None:
        # k, v: [T, Hkv, d]; fills the tail, sealing it (and starting a new one) at each block edge
        n, T, b, i = self.n[layer], k.shape[0], self.block, 0
        while i < T:
            off = (n + i) % b
            m = min(b - off, T - i)
            self._reserve(layer, off, off + m)
            self.tail_k[layer][off:off + m].copy_(k[i:i + m], non_blocking=non_blocking)
            self.tail_v[layer][off:off + m].copy_(v[i:i + m], non_blocking=non_blocking)
            i += m
            if off + m == b:
                self.sealed_k[layer].append(self.tail_k[layer])
                self.sealed_v[layer].append(self.tail_v[layer])
                self.tail_k[layer] = self.tail_v[layer] = None

    def _blocks(self, layer: int, which: str) -> list[torch.Tensor]:
        sealed, tail = (self.sealed_k, self.tail_k) if which == "k" else (self.sealed_v, self.tail_v)
        return sealed[layer] + ([tail[layer]] if tail[layer] is not None else [])

    def _rows(self, layer: int, heads: np.ndarray | None, positions: np.ndarray,
              outs: tuple[torch.Tensor, ...]) -> None:
        # gathers (head, position) pairs (heads None: all heads) into outs, one index per block touched
        b, h = self.block, self.shape[1]
        blk = positions // b
        order = np.argsort(blk, kind="stable")
        blk_sorted = blk[order]
        cuts = np.flatnonzero(np.diff(blk_sorted)) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, blk_sorted.size]
        for which, out in zip("kv", outs):
            blocks = self._blocks(layer, which)
            for s, e in zip(starts, ends):
                if s == e:
                    continue
                rows = torch.from_numpy(order[s:e])
                off = positions[order[s:e]] % b
                src = blocks[int(blk_sorted[s])]
                if heads is None:
                    out[rows] = src[torch.from_numpy(off)]
                else:
                    flat = torch.from_numpy(off * h + heads[order[s:e]])
                    out[rows] = src.view(-1, src.shape[-1]).index_select(0, flat)

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
        M, d = positions.numel(), self.shape[2]
        k = out_k if out_k is not None else torch.empty(M, d, dtype=self.dtype)
        v = out_v if out_v is not None else torch.empty(M, d, dtype=self.dtype)
        if M:
            self._rows(layer, heads.numpy().astype(np.int64), positions.numpy().astype(np.int64), (k, v))
        return k, v

    def keys(self, positions: torch.Tensor) -> torch.Tensor:
        """Keys of ``positions`` in every layer, as [L, Hkv, M, d] float32 (for mean keys)."""
        L, h, d = self.shape
        pos = positions.numpy().astype(np.int64)
        out = []
        for layer in range(L):
            self.sync(layer)
            k = torch.empty(pos.size, h, d, dtype=self.dtype)
            if pos.size:
                self._rows(layer, None, pos, (k,))
            out.append(k.transpose(0, 1).float())
        return torch.stack(out)

    def chunks(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``layer``'s positions in order as (K, V) views [m, Hkv, d] (one per block, the tail cut to
        what was written), after waiting for its copies; pinned on CUDA. Views, not copies: read only."""
        self.sync(layer)
        n, b = self.n[layer], self.block
        out = []
        for i, (k, v) in enumerate(zip(self._blocks(layer, "k"), self._blocks(layer, "v"))):
            m = min(b, n - i * b)
            out.append((k[:m], v[:m]))
        return out

    def buffers(self):
        """Every K and V block this store holds (sealed ones may be shared with forks)."""
        for layer in range(self.shape[0]):
            yield from self._blocks(layer, "k")
            yield from self._blocks(layer, "v")

    def allocated_bytes(self) -> int:
        """Bytes of the host K/V blocks this store holds (sealed ones may be shared with forks)."""
        return self._bytes

    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        L, h, d = self.shape
        return 2 * L * h * d * torch.tensor([], dtype=self.dtype).element_size()

    def fork(self) -> "HostKVStore":
        """A store holding the same positions that shares every sealed block and copies the tails.

        Cost: ``L · n / block`` list entries and < ``block`` positions copied per layer. Either side's
        later appends go to its own tail, so neither sees the other's (sealed blocks are never written).
        """
        other = HostKVStore.__new__(HostKVStore)
        other.shape, other.dtype, other.block, other.cuda = self.shape, self.dtype, self.block, self.cuda
        L = self.shape[0]
        other.sealed_k = [list(s) for s in self.sealed_k]
        other.sealed_v = [list(s) for s in self.sealed_v]
        other.tail_k, other.tail_v = [None] * L, [None] * L
        other._bytes = self._bytes   # the same reserve for the tails (below)
        for li in range(L):
            if self.tail_k[li] is not None:
                self.sync(li)
                used = self.n[li] % self.block
                for src, dst in ((self.tail_k, other.tail_k), (self.tail_v, other.tail_v)):
                    t = other._alloc(src[li].shape[0])   # the same reserve: a fork grows like its parent
                    t[:used] = src[li][:used]
                    dst[li] = t
        other.n = list(self.n)
        other._ready = [None] * L
        other._stream = self._stream
        return other


class PositionCount(HostKVStore):
    """The host store of a cache whose policy never selects a position it dropped (full KV kept resident,
    StreamingLLM, H2O, SnapKV, R-KV): it counts positions and keeps no K/V, so such a cache holds its
    active set and nothing else (host memory O(budget), not O(context)).

    Raises (on a read):
        RuntimeError: a gather, chunk or key read, which only a restoring policy needs.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.shape, self.dtype, self.cuda = (n_layers, n_kv_heads, head_dim), dtype, False
        self.n = [0] * n_layers
        self._bytes = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.n[layer] += k.shape[1]

    def sync(self, layer: int) -> None:
        pass

    def _read(self, *args, **kwargs):
        raise RuntimeError("this cache keeps no host copy of its K/V: its policy never restores an evicted "
                           "position (KVPolicy.restores_evicted)")

    gather = keys = chunks = _read

    def buffers(self):
        return iter(())

    def fork(self) -> "PositionCount":
        other = PositionCount(*self.shape, self.dtype)
        other.n = list(self.n)
        return other
