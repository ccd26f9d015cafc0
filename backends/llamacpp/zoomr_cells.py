"""``zoomr`` on llama.cpp: every position in a store sequence, ZoomR's selection in the active one.

Source: ZoomR paper §3.3 (votes of every layer and query head over mean summary keys, the c most-voted
segments zoomed in) and Algorithm 1; the selection is the torch backend's own code
(:class:`zoomr.kvstore.zoomr.ZoomRPolicy`), which already picks one set of positions for all layers and heads.

llama.cpp keeps no copy of a cell it removed, so nothing is evicted from its cache: each zoomr sequence owns
two sequence ids in one unified cell pool. The *active* id holds the selection and is the one decoded; each
new cell is then added to the *store* id (``seq_cp`` of the new positions; a batch row tagged with both ids
would attend the cells of both), which keeps every position. At each
recompute the active id's membership moves with ``llama_memory_seq_rm`` (positions leaving) and
``llama_memory_seq_cp`` from the store (positions zoomed back in): no cell is copied or decoded again, and
positions never shift, so every cell keeps the rotation it was written at.

What it saves is attention, not memory: llama.cpp's KV cache holds every position (``-c`` cells), as full
KV does. With flash attention (llama.cpp's default where it runs) a forward skips the cells its sequence does
not hold; without it the whole pool is attended and masked, and nothing is saved
(``benchmarks/llamacpp_masked_attention.py`` measures both). The model line and ``kv_stats`` say so.

Queries and keys come from the forward (:class:`zoomr.backends.llamacpp.capture.KQCapture`); the keys of
every position are kept on the host (:class:`KeyLog`, ``n_layer × n_head_kv × d`` floats a token), where
ZoomR reads the mean key of each closed segment. The policy is bound as one "layer" of ``n_layer × n_head``
query heads: a vote per (layer, head) pair is the same count either way.
"""

from __future__ import annotations

import numpy as np
import torch

from zoomr.kvstore.events import EventBus
from zoomr.kvstore.policy import ForwardInfo, LayerView, PolicyContext
from zoomr.kvstore.zoomr import ZoomRConfig

from .scored import Shapes, heads_first


class KeyLog:
    """Post-RoPE keys of the positions ``[base, n)`` on the host, float32 ``[rows, n − base, d]``: ZoomR reads a
    segment's keys once, when it closes, so positions before the oldest open segment are dropped
    (:meth:`prune`) and the log stays O(open segment), not O(sequence).

    Args:
        rows: ``n_layer × n_head_kv``; head_dim: d (elements).
    """

    def __init__(self, rows: int, head_dim: int):
        self._buf = torch.empty(rows, 32, head_dim)   # grows to the open segment's length, then stays
        self.base = self.n = 0

    def append(self, keys: torch.Tensor) -> None:
        """Keys of the next positions, [rows, T, d]."""
        T, used = keys.shape[1], self.n - self.base
        if used + T > self._buf.shape[1]:
            grown = torch.empty(self._buf.shape[0], max(2 * self._buf.shape[1], used + T), self._buf.shape[2])
            grown[:, :used] = self._buf[:, :used]
            self._buf = grown
        self._buf[:, used:used + T] = keys
        self.n += T

    def prune(self, before: int) -> None:
        """Drop the keys of positions below ``before`` (they are never read again)."""
        drop = min(before, self.n) - self.base
        if drop > 0:
            used = self.n - self.base
            self._buf[:, :used - drop] = self._buf[:, drop:used].clone()
            self.base += drop

    def keys(self, positions: torch.Tensor) -> torch.Tensor:
        """Keys of ``positions`` [n] (int64, in ``[base, n)``): [1, rows, n, d] (the host store's layout,
        one layer).

        Raises:
            IndexError: a position already pruned.
        """
        if len(positions) and int(positions.min()) < self.base:
            raise IndexError(f"key of position {int(positions.min())} was dropped (log starts at {self.base})")
        return self._buf[:, positions - self.base][None]

    def nbytes(self) -> int:
        """Bytes held (the buffer, grown ahead of use)."""
        return self._buf.numel() * self._buf.element_size()


class ZoomRCells:
    """One sequence's ZoomR on llama.cpp (see the module docstring).

    Args:
        config: ZoomR's knobs (window, k, c, summaries, segment tokens).
        n_ctx: ``-c``: the cells the store may hold, so the longest the sequence gets (tokens).
        events: where a recompute event goes (live display), or None.
    Raises:
        ValueError: knobs ZoomR refuses (a ``--window`` given at or above ``-c`` is refused by the CLI, on both
            backends; the default 512 with a smaller ``-c`` runs, as on torch, and evicts nothing).

    Attributes:
        cap: ``n_ctx``; bound: None (ZoomR's active size follows from the text, as on torch).
        written: every token id, by position (the store's tokens).
        restored: positions brought back into the active sequence by a zoom-in (tokens, summed).
    """

    evicts = True
    wants_text = True
    wants_kq = True
    shifts = False
    keeps_store = True          # two sequence ids: every position in the store, the selection active
    observes_chunks = False     # the whole prompt is one forward for ZoomR (its I_p)

    def __init__(self, config: ZoomRConfig, n_ctx: int, events: EventBus | None = None):
        self.policy, self.name = config.build(), "zoomr"
        self.cap, self.bound, self.events = n_ctx, None, events
        self.written: list[int] = []
        self.restored = 0
        self.log: KeyLog | None = None
        self._q: list[np.ndarray] | None = None
        self._selection: list[int] | None = None

    def bind(self, shapes: Shapes) -> None:
        """Attach to a loaded model (once, before the first forward)."""
        L, H, Hkv, d = shapes.n_layer, shapes.n_head, shapes.n_head_kv, shapes.head_dim
        self.log = KeyLog(L * Hkv, d)
        self.policy.bind(PolicyContext(1, L * H, L * Hkv, d, torch.device("cpu"), self.log, self._emit))

    def _emit(self, event) -> None:
        if self.events is not None:
            self.events.emit(event)

    def take_kq(self, q: list[np.ndarray], k: list[np.ndarray]) -> None:
        """One forward's (or prefill chunk's) queries and keys, per layer [T, H, d] and [T, Hkv, d]: the keys
        go to the log now, the newest queries wait for :meth:`observe`."""
        self.log.append(heads_first(k))
        self._q = q

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """A finished forward of ``ids`` at positions ``start …``; True when ZoomR recomputed its selection
        (the engine then calls :meth:`selection` and moves the active sequence's cells).

        Raises:
            RuntimeError: no queries were handed over.
        """
        if self._q is None:
            raise RuntimeError("ZoomRCells.observe without the forward's queries (take_kq)")
        q, self._q = heads_first(self._q), None                      # [L·H, T', d], T' ≤ len(ids)
        self.written.extend(ids)
        end = start + len(ids)
        self.policy.observe(LayerView(0, q, [], [], q.shape[1], end - q.shape[1]))
        selection = self.policy.end_forward(ForwardInfo(start, ids, text, start == 0))
        open_start = self.policy.tracker.open_start
        self.log.prune(end if open_start is None else open_start)
        if selection is None:
            return False
        self._selection = selection[0].tolist()
        return True

    def selection(self) -> list[int]:
        """The positions the active sequence holds from now on (ascending), once per recompute."""
        chosen, self._selection = self._selection, None
        return chosen

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """Nothing leaves the store: the context is full at ``-c`` (the engine says so)."""
        return []

    def fork(self):
        """Refused: a fork would need its own store (a copy of every position).

        Raises:
            ValueError: always.
        """
        raise ValueError("--policy zoomr on --backend llamacpp cannot fork a sequence (its store holds every "
                         "position); use --backend torch")

    def describe(self) -> str:
        """ZoomR's description and where its KV is, e.g. ``zoomr(k=2, c=2, window=512, summaries=auto; store
        keeps all)``."""
        return self.policy.describe()[:-1] + "; store keeps all)"

    def stats(self) -> dict:
        """ZoomR's counters (recomputes, segments, AG, the §3.5 formula) and the positions zoomed back in."""
        return {**self.policy.stats(), "restored_tokens": self.restored}

    def state_bytes(self) -> int:
        """Host bytes beside llama.cpp's cells: the key log and ZoomR's mean keys and queries."""
        return self.log.nbytes() + self.policy.state_bytes() if self.log is not None else 0
