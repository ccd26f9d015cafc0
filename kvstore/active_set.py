"""The device side of an offloaded KV cache: what attention reads, gathered from the host store.

Two shapes of it:

* :class:`ResidentActiveSet` (ZoomR §3.4, with the "move only what changed" refinement of the issue):
  per layer, the K/V of the selected positions stay on the compute device between steps, new tokens
  are appended in place, and a new selection moves host → device only the (head, position) pairs
  that are not resident yet; resident ones are gathered on the device. On CUDA, layer l+1's new
  selection is applied on a side stream (pinned staging, non-blocking copies, an event) while layer l
  computes (the class docstring has the timeline). A fork freezes what is resident into read-only
  *parts* both sides read in place; each side appends to small buffers of its own.
* :class:`StreamedActiveSet`: nothing stays on the device; every step each layer's full KV is copied
  host → device just before it is attended (layer l+1 prefetched during layer l) and dropped after.
  This is the "offloaded full KV" baseline the paper measures ZoomR against (§4, Fig. 3a).

Both answer ``attend_parts(layer, k_new, v_new, pos_new) -> [(K_i, V_i, positions_i)]`` in position
order, the new tokens last (``attend``: the same as one contiguous triple).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .base import join_parts
from .host_store import HostKVStore


GROW_MIN = 64  # positions: the least room a layer's own buffers gain when they grow or take a selection
MAX_PARTS = 4        # frozen parts per layer before a fork merges them into one (as FullKVCache.MAX_PARTS)
# positions: the least room gained instead of GROW_MIN once a set forked (its first own buffers after the
# fork hold this many): a candidate of a few dozen tokens must not reserve an active set's worth
FORK_CAPACITY = 16


# sources an indexed selection may read before it is copied into one buffer (each costs a gather per forward)
MAX_SOURCES = 6


class _Indexed(NamedTuple):
    """A selection attended in place: for each head and selected slot, which source tensor and index hold the
    pair (CPU only). The sources are frozen parts shared with other forks, or this set's own retired buffers.

    sources: [(k, v)], each [Hkv, n_s, d]; src, idx: [Hkv, M] int64 numpy (source of each slot, index within it);
    pos: [Hkv, M] int64 CPU positions; plan: per source (k_rows, v_rows, src_row, dst_row): the source as
    [rows, d] views (:func:`_rows`), the rows it gives and the rows of the [Hkv·M, d] result they fill.
    """

    sources: list
    src: np.ndarray
    idx: np.ndarray
    pos: torch.Tensor
    plan: list


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` [Hkv, n, d] as a [rows, d] view of its storage, and the rows from one head to the next: pair
    (head h, index i) is row ``h·step + i``. A layout other than rows of d contiguous values (a cache view
    sliced from a larger buffer is fine) is first copied into one."""
    h, n, d = t.shape
    if t.stride(2) != 1 or (n > 1 and t.stride(1) != d) or (h > 1 and t.stride(0) % d):
        t = t.contiguous()
    step = t.stride(0) // d if h > 1 else 0
    return t.as_strided(((h - 1) * step + n, d), (d, 1)), step


class _Part(NamedTuple):
    """One frozen, read-only run of resident pairs of a layer, shared by every fork that holds it.

    k, v: [Hkv, n, d] device views; pos_host: [Hkv, n] int64 CPU; pos_dev: the same on the device (the
    same tensor as ``pos_host`` off CUDA).
    """

    k: torch.Tensor
    v: torch.Tensor
    pos_host: torch.Tensor
    pos_dev: torch.Tensor


def _merge(parts: list[_Part], cuda: bool) -> _Part:
    """One part holding ``parts`` concatenated in order (O(their positions), fresh storage)."""
    k = torch.cat([p.k for p in parts], dim=1)
    v = torch.cat([p.v for p in parts], dim=1)
    pos = torch.cat([p.pos_host for p in parts], dim=1)
    return _Part(k, v, pos, torch.cat([p.pos_dev for p in parts], dim=1) if cuda else pos)


class ResidentActiveSet:
    """Selected K/V resident on the compute device, per layer.

    Args:
        store: the host store the selections are read from.
        device, dtype: compute device and dtype.
        inplace: apply a new selection inside the own buffers when the layer holds no frozen parts
            and it fits, copying only the pairs that moved or came from the host (peak extra memory:
            the moved pairs, instead of a second buffer the size of the selection). Default: on CUDA
            only; the CPU default keeps fresh buffers per selection.

    Storage per layer: zero or more frozen :class:`_Part` s (read-only, shared with the sets this one
    forked from or into), then the set's own buffers ``k``, ``v``, ``pos_host``, ``pos_dev`` ([Hkv, cap, ...],
    None until written) of which the first ``n`` positions are used. What attention reads is the parts and
    the own used positions, in that order (rows sorted by position: appends are newer than what they follow).
    A fork freezes the own used positions into one more part for both sides (no K/V copied; past
    ``MAX_PARTS`` parts they are merged into one, O(active) once per ``MAX_PARTS`` fork generations) and
    each side's appends go to own buffers starting at ``FORK_CAPACITY`` positions, so a family of forks
    that all decode holds the committed active set once (as :class:`zoomr.kvstore.base.FullKVCache`).
    A new selection gathers its pairs from parts and own buffers into fresh own buffers and drops the
    parts (they stay valid for the other forks), except on a CPU when every selected pair is resident: the
    set then keeps an *indexed* selection (:class:`_Indexed`): per head and slot, which shared part or
    retired own buffer holds the pair; no K/V is copied, and attention gathers one layer's selection
    ([Hkv, M, d], freed after that layer) per forward. An R-KV/SnapKV/H2O candidate of KV-Rescue thereby holds
    only its own tokens beyond the committed state (benchmarks/rescue_batch.py: peak KV of a step ≤ 1.09× the
    committed states plus the candidates' own tokens, 1.27× when the kept pairs were copied). A fork of an
    indexed set copies the selection once into a part both sides share; past ``MAX_SOURCES`` sources, or with
    pairs to bring from the host store (SumR/ZoomR), the selection is gathered into own buffers as before.
    Own buffers grow by a quarter, at least ``room`` positions: ``GROW_MIN``, or ``FORK_CAPACITY`` once the
    set forked (a candidate decoding a few dozen tokens, compressed or not, then reserves about what it
    writes).

    Attributes:
        moved_pairs: (KV head, position) pairs copied host → device by selections so far.
        unchanged_selections: layer selections that equalled what was resident, so nothing moved.
        parts: per layer, the frozen :class:`_Part` s in position order.
        n: per layer, own positions used (after the parts).

    CUDA timeline (untested on a GPU so far): a selection computed on the device (H2O, SnapKV, R-KV)
    stays there; :meth:`schedule` queues its copy into pinned host memory on the compute stream with an
    event and returns without waiting. It is applied one forward later, on the side stream, while the
    previous layer computes (:meth:`prefetch`): the host waits for that event (by then long complete,
    since the step's logits or token id already crossed to the host), does the per-row book-keeping in
    numpy, and queues, all non-blocking: index vectors from pinned memory, one device gather of the
    resident pairs that moved, one pinned-staging copy of the pairs read from the host store, and the
    positions (device-to-device from the selection, or from a pinned copy of a host-computed one).
    The compute stream waits for the side stream's event only right before that layer's attention.
    New tokens' positions are made on the device (``arange``), so a decode step moves no position
    host → device. What still synchronizes the host: the staging buffers are reused per layer only
    after the previous copy out of them completed (one step earlier).
    """

    def __init__(self, store: HostKVStore, device: torch.device, dtype: torch.dtype, inplace: bool | None = None):
        L, self.h, self.d = store.shape
        self.store, self.device, self.dtype = store, device, dtype
        self.cuda = device.type == "cuda"
        self.inplace = self.cuda if inplace is None else inplace
        self.k: list[torch.Tensor | None] = [None] * L
        self.v: list[torch.Tensor | None] = [None] * L
        self.pos_host: list[torch.Tensor | None] = [None] * L   # [Hkv, cap] int64, CPU mirror
        self.pos_dev: list[torch.Tensor | None] = [None] * L    # same on the device
        self.n = [0] * L
        self.pending: list[torch.Tensor | None] = [None] * L    # next selection [Hkv, M], CPU
        self.moved_pairs = 0
        self.unchanged_selections = 0   # selections equal to what was resident: applied without a copy
        self.parts: list[list[_Part]] = [[] for _ in range(L)]
        self.indexed: list[_Indexed | None] = [None] * L   # CPU: a fork's selection read in place (no parts then)
        self.room = GROW_MIN   # least positions own buffers gain (FORK_CAPACITY once forked)
        self._bytes: int | None = None   # device_bytes, recounted only after a buffer changed
        self._sel_dev: list[torch.Tensor | None] = [None] * L   # CUDA: the pending selection, on the device
        self._sel_ev: list[torch.cuda.Event | None] = [None] * L  # CUDA: its copy into ``pending`` is done
        self._ready: list[torch.cuda.Event | None] = [None] * L
        self._staging: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * L
        self._staged: list[torch.cuda.Event | None] = [None] * L   # last copy out of the staging buffers
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    # -- selection -------------------------------------------------------------------------------
    def schedule(self, layer: int, selection: torch.Tensor) -> None:
        """Attend exactly ``selection`` (+ new tokens) from the next forward of ``layer`` on.

        Args:
            selection: [Hkv, M] int64 positions, each row sorted ascending and unique, all < the
                positions written; the same M for every head. On CUDA a device tensor is copied to
                the host asynchronously (no wait here; see the class docstring).
        """
        if self.cuda and selection.device.type == "cuda":
            sel = selection.to(torch.long).contiguous()
            host = torch.empty(sel.shape, dtype=torch.long, pin_memory=True)
            host.copy_(sel, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.pending[layer], self._sel_dev[layer], self._sel_ev[layer] = host, sel, ev
        else:
            self.pending[layer] = selection.to("cpu", torch.long)
            self._sel_dev[layer] = self._sel_ev[layer] = None
        self._ready[layer] = None

    def prefetch(self, layer: int) -> None:
        """CUDA: start applying ``layer``'s pending selection on the side stream (no-op elsewhere)."""
        if not self.cuda or layer >= len(self.k) or self.pending[layer] is None or self._ready[layer]:
            return
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            for t in (self.k[layer], self.v[layer], self.pos_dev[layer], self._sel_dev[layer],
                      *(t for part in self.parts[layer] for t in (part.k, part.v, part.pos_dev))):
                if t is not None:
                    t.record_stream(self._stream)   # the old buffers (and the selection) are read here
            self._apply(layer)
            for t in (self.k[layer], self.v[layer], self.pos_dev[layer]):
                if t is not None:                   # None: a selection left as it was, only parts resident
                    t.record_stream(cur)            # the new ones are used on the compute stream
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._ready[layer] = self._staged[layer] = ev

    def _ensure(self, layer: int) -> None:
        if self.pending[layer] is None:
            return
        if self.cuda:
            self.prefetch(layer)
            torch.cuda.current_stream(self.device).wait_event(self._ready[layer])
            self._ready[layer] = None
        else:
            self._apply(layer)
        self.pending[layer] = None
        self._sel_dev[layer] = self._sel_ev[layer] = None

    def _index(self, a: np.ndarray) -> torch.Tensor:
        """A flat int64 index on the device; on CUDA through pinned memory, so the copy is asynchronous."""
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64).reshape(-1))
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t.to(self.device)

    def _apply(self, layer: int) -> None:
        # Book-keeping (which selected pairs are resident, and where) runs in numpy on the host: these
        # are tiny per-row searches that torch would parallelize at a loss. Data moves as one flat
        # index_select on the device plus one from the host store for the pairs not resident (with frozen
        # parts: one gather from each part and the own buffers, into fresh buffers).
        if self._sel_ev[layer] is not None:
            self._sel_ev[layer].synchronize()   # the selection's copy to the host, queued a forward ago
        sel = self.pending[layer].numpy()
        h, M = sel.shape
        n = self.n[layer]
        old = self._positions(layer).numpy()
        total = old.shape[1]
        if total:
            slot = np.stack([np.searchsorted(old[r], sel[r]) for r in range(h)]).clip(max=total - 1)
            hit = np.take_along_axis(old, slot, 1) == sel
        else:
            hit = np.zeros(sel.shape, dtype=bool)
        if M == total and hit.all() and (slot == np.arange(M)).all():
            # the selection is exactly what is resident (SumR/ZoomR before their window fills, a budget not yet
            # reached): parts, indexed selection and own buffers stay as they are, nothing is copied
            self.unchanged_selections += 1
            return
        if self._index_in_place(layer, sel, slot if total else None, hit):
            return
        if self.indexed[layer] is not None:   # read by the gathers below as an ordinary part
            self._materialize(layer)
        parts = self.parts[layer]
        # own buffers are never shared (a fork freezes them into a part), so they may be rewritten in place
        inplace = self.inplace and n > 0 and not parts and M <= self.k[layer].shape[1]
        if inplace:
            k, v, cap = self.k[layer], self.v[layer], self.k[layer].shape[1]
            mh, mc = np.nonzero(hit & (slot != np.arange(M)[None, :]))   # resident, but in another slot
            if mh.size:
                src, dst = self._index(mh * cap + slot[mh, mc]), self._index(mh * cap + mc)
                for t in (k, v):
                    flat = t.view(-1, self.d)
                    flat.index_copy_(0, dst, flat.index_select(0, src))   # the gather is complete first
        else:
            cap = M + max(self.room, M // 4)
            k = torch.empty(h, cap, self.d, device=self.device, dtype=self.dtype)
            v = torch.empty_like(k)
            if parts:
                self._gather_parts(layer, slot, hit, k, v)
            elif n:
                old_cap = self.k[layer].shape[1]
                flat = self._index(slot + np.arange(h)[:, None] * old_cap)
                k[:, :M] = self.k[layer].view(-1, self.d).index_select(0, flat).view(h, M, self.d)
                v[:, :M] = self.v[layer].view(-1, self.d).index_select(0, flat).view(h, M, self.d)
        heads, cols = np.nonzero(~hit)
        if heads.size:
            hk, hv = self.store.gather(layer, torch.from_numpy(heads), torch.from_numpy(sel[heads, cols]),
                                       *self._stage(layer, heads.size))
            dst = self._index(heads * cap + cols)
            k.view(-1, self.d).index_copy_(0, dst, hk.to(self.device, non_blocking=True))
            v.view(-1, self.d).index_copy_(0, dst, hv.to(self.device, non_blocking=True))
            self.moved_pairs += int(heads.size)
        pos = self.pos_host[layer] if inplace else torch.empty(h, cap, dtype=torch.long)
        pos[:, :M] = self.pending[layer]
        if not self.cuda:
            dev = pos
        else:
            dev = self.pos_dev[layer] if inplace else torch.empty(h, cap, dtype=torch.long, device=self.device)
            if self._sel_dev[layer] is not None:
                dev[:, :M].copy_(self._sel_dev[layer])
            else:
                dev[:, :M].copy_(self.pending[layer].contiguous().pin_memory(), non_blocking=True)
        self.k[layer], self.v[layer], self.n[layer] = k, v, M
        self.pos_host[layer], self.pos_dev[layer] = pos, dev
        self.parts[layer] = []   # everything selected is in the own buffers now
        self._bytes = None

    def _gather_parts(self, layer: int, slot: np.ndarray, hit: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the resident selected pairs into ``k``/``v`` [Hkv, cap, d] from the frozen parts and the own
        used positions: ``slot`` [Hkv, M] indexes their concatenation, ``hit`` [Hkv, M] marks resident pairs."""
        start = 0
        sources = [(p.k, p.v) for p in self.parts[layer]]
        if self.n[layer]:
            sources.append((self.k[layer][:, :self.n[layer]], self.v[layer][:, :self.n[layer]]))
        for sk, sv in sources:
            m = sk.shape[1]
            hh, cc = np.nonzero(hit & (slot >= start) & (slot < start + m))
            if hh.size:
                heads, src, dst = self._index(hh), self._index(slot[hh, cc] - start), self._index(cc)
                k[heads, dst] = sk[heads, src]
                v[heads, dst] = sv[heads, src]
            start += m

    def _index_in_place(self, layer: int, sel: np.ndarray, slot: np.ndarray | None, hit: np.ndarray) -> bool:
        """CPU, a set that reads shared parts (or already an indexed selection): take a selection whose pairs
        are all resident as an index into where they are, copying no K/V (the R-KV/SnapKV/H2O compression of a
        rescue candidate would otherwise duplicate the committed pairs it keeps). The own used positions
        retire into a source; new tokens go to fresh own buffers. Returns False where it does not apply (CUDA,
        nothing shared, pairs to bring from the host store, or more than ``MAX_SOURCES`` sources): the caller
        then gathers into fresh buffers."""
        ix, parts, n = self.indexed[layer], self.parts[layer], self.n[layer]
        if self.cuda or slot is None or not (parts or ix is not None) or not hit.all():
            return False
        h = sel.shape[0]
        sources, src_of, idx_of = (list(ix.sources), [ix.src], [ix.idx]) if ix is not None else ([], [], [])
        # the own used positions retire at their size (a copy of this fork's own tokens: its buffers' spare room
        # would otherwise stay held for as long as a slot reads them)
        own = [(self.k[layer][:, :n].clone(), self.v[layer][:, :n].clone())] if n else []
        for k, v in [(p.k, p.v) for p in parts] + own:
            m = k.shape[1]
            src_of.append(np.full((h, m), len(sources), dtype=np.int64))
            idx_of.append(np.broadcast_to(np.arange(m, dtype=np.int64), (h, m)))
            sources.append((k, v))
        src = np.take_along_axis(np.concatenate(src_of, axis=1), slot, 1)
        idx = np.take_along_axis(np.concatenate(idx_of, axis=1), slot, 1)
        used = np.unique(src)
        if used.size > MAX_SOURCES:
            return False
        remap = np.zeros(len(sources), dtype=np.int64)
        remap[used] = np.arange(used.size)
        src = remap[src]
        sources = [sources[u] for u in used]   # sources no slot reads are let go
        plan = []
        M = sel.shape[1]
        for s, (k, v) in enumerate(sources):
            hh, cc = np.nonzero(src == s)
            (k_rows, step), (v_rows, _) = _rows(k), _rows(v)
            plan.append((k_rows, v_rows, self._index(hh * step + idx[hh, cc]), self._index(hh * M + cc)))
        self.indexed[layer] = _Indexed(sources, src, idx, torch.from_numpy(sel.copy()), plan)
        self.parts[layer] = []
        self.k[layer] = self.v[layer] = self.pos_host[layer] = self.pos_dev[layer] = None
        self.n[layer] = 0
        self._bytes = None
        return True

    def _gathered(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexed selection's K and V, [Hkv, M, d] each, gathered from its sources into fresh tensors."""
        ix = self.indexed[layer]
        M = ix.src.shape[1]
        k = torch.empty(self.h, M, self.d, device=self.device, dtype=self.dtype)
        v = torch.empty_like(k)
        # flat row copies: index_select/index_copy_ over [rows, d] views ran about twice as fast as the
        # equivalent two-index advanced indexing on a CPU
        for k_rows, v_rows, src, dst in ix.plan:
            k.view(-1, self.d).index_copy_(0, dst, k_rows.index_select(0, src))
            v.view(-1, self.d).index_copy_(0, dst, v_rows.index_select(0, src))
        return k, v

    def _materialize(self, layer: int) -> None:
        """Copy the indexed selection into one buffer, held as this layer's only part (its sources let go)."""
        ix = self.indexed[layer]
        k, v = self._gathered(layer)
        self.parts[layer] = [_Part(k, v, ix.pos, ix.pos)]
        self.indexed[layer] = None
        self._bytes = None

    def kv(self, layer: int) -> tuple[torch.Tensor, ...]:
        """(K, V) resident for ``layer`` now, [Hkv, N, d] each in position order, N as :meth:`positions`: the
        frozen parts, an indexed selection (gathered), the own used positions (:func:`join_parts`: views when
        there is one source, else fresh tensors); empty [Hkv, 0, d] tensors when nothing is resident."""
        parts = [(p.k, p.v) for p in self.parts[layer]]
        if self.indexed[layer] is not None:
            parts.append(self._gathered(layer))
        if self.n[layer]:
            parts.append((self.k[layer][:, :self.n[layer]], self.v[layer][:, :self.n[layer]]))
        if not parts:
            empty = torch.empty(self.h, 0, self.d, device=self.device, dtype=self.dtype)
            return empty, empty
        return join_parts(parts)

    def _positions(self, layer: int) -> torch.Tensor:
        """[Hkv, N] positions resident in ``layer`` (CPU): the parts' then the own used ones (a view
        when there is a single source, else a fresh concatenation)."""
        pos = [p.pos_host for p in self.parts[layer]]
        if self.indexed[layer] is not None:
            pos.append(self.indexed[layer].pos)
        if self.n[layer]:
            pos.append(self.pos_host[layer][:, :self.n[layer]])
        if not pos:
            return torch.empty(self.h, 0, dtype=torch.long)
        return pos[0] if len(pos) == 1 else torch.cat(pos, dim=1)

    def _stage(self, layer: int, m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pinned host buffers for ``m`` gathered rows (CUDA), so the H2D copy is truly asynchronous."""
        if not self.cuda:
            return None, None
        if self._staged[layer] is not None:
            self._staged[layer].synchronize()   # the previous copy out of these buffers must be done
        st = self._staging[layer]
        if st is None or st[0].shape[0] < m:
            rows = max(m, 2 * (st[0].shape[0] if st else 0), 256)
            st = tuple(torch.empty(rows, self.d, dtype=self.dtype, pin_memory=True) for _ in range(2))
            self._staging[layer] = st
        return st[0][:m], st[1][:m]

    # -- attention -------------------------------------------------------------------------------
    def attend_parts(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Apply ``layer``'s pending selection, append the T new tokens, return what attention reads.

        Args:
            k_new, v_new: [Hkv, T, d] on the device.
            pos_new: [T] int64 positions of the new tokens (CPU).
        Returns:
            [(K_i, V_i, positions_i)]: [Hkv, n_i, d], [Hkv, n_i, d], [Hkv, n_i] int64 on the device, in
            position order: the frozen parts, then the own positions with the T new tokens last. Views of
            buffers forks may share: read them, never write.
        """
        self._ensure(layer)
        T = k_new.shape[1]
        n = self.n[layer]
        if self.k[layer] is None or n + T > self.k[layer].shape[1]:
            self._grow(layer, n + T)
        self.k[layer][:, n:n + T] = k_new
        self.v[layer][:, n:n + T] = v_new
        self.pos_host[layer][:, n:n + T] = pos_new
        if self.cuda and T:
            p0 = int(pos_new[0])
            if int(pos_new[-1]) - p0 == T - 1:   # consecutive (always, from PolicyKVCache): made on the device
                self.pos_dev[layer][:, n:n + T] = torch.arange(p0, p0 + T, device=self.device)
            else:
                self.pos_dev[layer][:, n:n + T] = pos_new.pin_memory().to(self.device, non_blocking=True)
        self.n[layer] = n + T
        self.prefetch(layer + 1)
        m = n + T
        own = (self.k[layer][:, :m], self.v[layer][:, :m], self.pos_dev[layer][:, :m])
        if self.indexed[layer] is not None:   # gathered for this forward only: one layer's selection at a time
            k, v = self._gathered(layer)
            return [(k, v, self.indexed[layer].pos), own]
        return [*((p.k, p.v, p.pos_dev) for p in self.parts[layer]), own]

    def attend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, pos_new: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`attend_parts` as one (K, V, positions) triple, [Hkv, N, d] / [Hkv, N]: views of the own
        buffers when there are no frozen parts, else a fresh concatenation (O(N) per call)."""
        return join_parts(self.attend_parts(layer, k_new, v_new, pos_new))

    def _grow(self, layer: int, need: int) -> None:
        cap = 0 if self.k[layer] is None else self.k[layer].shape[1]
        # geometric (a quarter more): amortized O(1) copies per token, at most 25 % (or ``room``) unused
        new_cap = max(need, cap + max(self.room, cap // 4))
        n = self.n[layer]
        k = torch.empty(self.h, new_cap, self.d, device=self.device, dtype=self.dtype)
        v = torch.empty_like(k)
        pos = torch.empty(self.h, new_cap, dtype=torch.long)
        if n:
            k[:, :n], v[:, :n], pos[:, :n] = self.k[layer][:, :n], self.v[layer][:, :n], self.pos_host[layer][:, :n]
        self.k[layer], self.v[layer], self.pos_host[layer] = k, v, pos
        if self.cuda:
            dev = torch.empty(self.h, new_cap, dtype=torch.long, device=self.device)
            if n:
                dev[:, :n] = self.pos_dev[layer][:, :n]
            self.pos_dev[layer] = dev
        else:
            self.pos_dev[layer] = pos
        self._bytes = None

    # -- accounting ------------------------------------------------------------------------------
    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, N] positions resident in ``layer`` now (CPU copy, parts then own): those attended at its
        last forward, or the pending selection once it has been applied (fork applies it)."""
        return self._positions(layer).clone()

    def device_bytes(self) -> int:
        """Bytes of the device K/V storages this set reads now (capacity, not just the used part): its own
        buffers and its frozen parts' storages, each storage once (shared with a fork: counted in both)."""
        if self._bytes is None:
            seen = {}
            for t in self.buffers():
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            self._bytes = sum(seen.values())
        return self._bytes

    def buffers(self):
        """The device K and V tensors held now: own buffers and frozen parts (views of storages possibly
        shared with forks; :func:`zoomr.kvstore.stats.distinct_kv_bytes` counts each storage once)."""
        for layer in range(len(self.k)):
            for p in self.parts[layer]:
                yield p.k
                yield p.v
            if self.indexed[layer] is not None:
                for k, v in self.indexed[layer].sources:
                    yield k
                    yield v
            for t in (self.k[layer], self.v[layer]):
                if t is not None:
                    yield t

    def _freeze(self, layer: int) -> None:
        """Turn ``layer``'s own used positions into one more frozen part (all parts merged past MAX_PARTS)."""
        if self.indexed[layer] is not None:   # both sides then read one compact copy of the selection
            self._materialize(layer)
        n = self.n[layer]
        parts = self.parts[layer]
        if n:
            parts.append(_Part(self.k[layer][:, :n], self.v[layer][:, :n], self.pos_host[layer][:, :n],
                               self.pos_dev[layer][:, :n]))
        if len(parts) > MAX_PARTS:
            parts[:] = [_merge(parts, self.cuda)]
        self.k[layer] = self.v[layer] = self.pos_host[layer] = self.pos_dev[layer] = None
        self.n[layer] = 0
        self._bytes = None

    def fork(self, store: HostKVStore) -> "ResidentActiveSet":
        """A set over ``store`` (the fork of this one's store) reading this one's resident pairs in place.

        Pending selections are applied here first (once, for both). Each layer's own used positions are
        frozen into a shared part (:meth:`_freeze`); both sides append to own buffers from then on.
        Cost: O(L), no K/V copied (but every ``MAX_PARTS`` fork generations, a merge: O(active)).
        """
        other = ResidentActiveSet(store, self.device, self.dtype, self.inplace)
        for li in range(len(self.k)):
            self._ensure(li)
            self._freeze(li)
            other.parts[li] = list(self.parts[li])
        self.room = other.room = FORK_CAPACITY
        other.moved_pairs = self.moved_pairs
        other._stream = self._stream
        return other


class StreamedActiveSet:
    """Full KV offloaded: each layer's K/V are copied host → device right before attention, then dropped.

    On the CPU there is no device to copy to: each step the stored blocks are copied once into the
    tensor attention reads (what the offloaded baseline costs there).

    Only the ``full`` policy fits this shape (it has no selection to apply). On CUDA the next layer's
    copy is issued on a side stream while the current layer computes (one non-blocking copy per pinned
    block of the store, into one device buffer per tensor).
    """

    def __init__(self, store: HostKVStore, device: torch.device, dtype: torch.dtype):
        L, self.h, self.d = store.shape
        self.store, self.device, self.dtype = store, device, dtype
        self.cuda = device.type == "cuda"
        self.n = [0] * L
        self.moved_pairs = 0
        self._next: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def schedule(self, layer: int, selection: torch.Tensor) -> None:
        """Raises ValueError: a streamed full cache has no selection to apply."""
        raise ValueError("the streamed (offloaded full) KV cache attends every position; it takes no selection")

    def prefetch(self, layer: int) -> None:
        """CUDA: start copying ``layer``'s stored K/V to the device on the side stream (no-op elsewhere).

        The store's pinned blocks are copied into one [n, Hkv, d] buffer per tensor, non-blocking,
        ``n / block`` copies of each per layer; they overlap the current layer's compute.
        """
        if not self.cuda or layer >= len(self.n) or layer in self._next:
            return
        chunks = self.store.chunks(layer)          # [m, Hkv, d] views of the pinned blocks
        n = sum(ck.shape[0] for ck, _ in chunks)
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            k = torch.empty(n, self.h, self.d, dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            s = 0
            for ck, cv in chunks:
                m = ck.shape[0]
                k[s:s + m].copy_(ck, non_blocking=True)
                v[s:s + m].copy_(cv, non_blocking=True)
                s += m
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            k.record_stream(cur)
            v.record_stream(cur)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._next[layer] = (k, v, ev)

    def attend(self, layer, k_new, v_new, pos_new):
        """See :meth:`ResidentActiveSet.attend`; the stored part is every position before ``pos_new``."""
        T = k_new.shape[1]
        old = int(pos_new[0])
        self.moved_pairs += self.h * old
        self.n[layer] = old + T
        pos = torch.arange(old + T, device=self.device).expand(self.h, -1)
        if not self.cuda:
            # one pass: each stored block, transposed, straight into the tensor attention reads
            K = torch.empty(self.h, old + T, self.d, dtype=k_new.dtype)
            V = torch.empty_like(K)
            s = 0
            for ck, cv in self.store.chunks(layer):
                m = min(ck.shape[0], old - s)
                if m <= 0:
                    break
                K[:, s:s + m], V[:, s:s + m] = ck[:m].transpose(0, 1), cv[:m].transpose(0, 1)
                s += m
            K[:, old:], V[:, old:] = k_new, v_new
            return K, V, pos
        # the host store already holds this forward's tokens: attend only the positions before them
        if layer not in self._next:
            self.prefetch(layer)
        k, v, ev = self._next.pop(layer)
        torch.cuda.current_stream(self.device).wait_event(ev)
        K = torch.cat([k[:, :old], k_new], dim=1)
        V = torch.cat([v[:, :old], v_new], dim=1)
        self.prefetch(layer + 1)
        return K, V, pos

    def attend_parts(self, layer, k_new, v_new, pos_new):
        """:meth:`attend` as a single part (see :meth:`ResidentActiveSet.attend_parts`)."""
        return [self.attend(layer, k_new, v_new, pos_new)]

    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, N] positions attended at ``layer``'s last forward (all of them)."""
        return torch.arange(self.n[layer]).expand(self.h, -1).clone()

    def device_bytes(self) -> int:
        """Bytes of prefetched device K/V held right now (at most about one layer)."""
        return sum(2 * k.numel() * k.element_size() for k, _, _ in self._next.values())

    def buffers(self):
        """The prefetched device K and V held right now (at most about one layer)."""
        for k, v, _ in self._next.values():
            yield k
            yield v

    def fork(self, store: HostKVStore) -> "StreamedActiveSet":
        """A fresh streamed set over ``store`` (nothing of it stays on the device to share)."""
        other = StreamedActiveSet(store, self.device, self.dtype)
        other.n = list(self.n)
        other._stream = self._stream
        return other
