"""Score-ranked policies (H2O, SnapKV, R-KV, KeyDiff) on llama.cpp cells, scored by the torch backend's code.

The policy object is the torch backend's own (:mod:`zoomr.kvstore.h2o`, ``snapkv``, ``rkv``, ``keydiff``), in
its ``shared`` selection (:class:`zoomr.kvstore.policy.ScoredPolicy`): a llama.cpp cell holds one position for
every layer and KV head, so the only thing a cell policy can follow is one set of positions. It is bound to a
context of one "layer" with ``n_layer × n_head_kv`` KV heads: all layers scored in one call (a per-layer loop
would cost 30 small calls a token), and a shared selection over that one layer is the mean over every layer
and KV head, as on the torch backend.

What the policy reads comes from the forward itself (:class:`zoomr.backends.llamacpp.capture.KQCapture`): the
new tokens' rotated queries, and their keys, which are kept in a host shadow of the resident cells' keys
(``n_layer × n_head_kv × d`` floats a cell, O(budget)). Positions are never shifted: an evicted cell leaves a
hole (``llama_memory_seq_rm`` only) and every cell keeps the position, and so the rotation, it was written at,
as the torch backend keeps original positions. So the same tokens give both backends the same scores up to
llama.cpp's arithmetic (quantized dot products, an f16 cache), and ``benchmarks/policy_parity.py`` counts the
decisions on which they agree.

When R-KV and SnapKV compress is the torch policy's own schedule (:mod:`zoomr.kvstore.schedule`): R-KV leaves
the prompt whole until the first decode step after a multiple of 128 positions was written, so the cells hold
up to that multiple + 1 (≤ P + 128). The cells are sized before any prompt is seen, at ``cap`` = the policy's
bound + ``room`` (512 by default), so prompts up to about B + ``room`` stay whole as on the torch backend; the
schedule's hard cap is set to ``cap``, so a longer prompt, prefilled in chunks, is compressed whenever the cells
fill, and its first decode steps attend at most ``cap``. The schedule's prompt is the sequence's first forward,
so a prompt longer than ``n_batch`` (512), prefilled in chunks, is one prompt chunk and then decode-phase
forwards to it: R-KV compresses at a chunk that writes a multiple of 128 (the second writes position 512).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from zoomr.kvstore.knobs import PolicyConfig
from zoomr.kvstore.policy import ForwardInfo, LayerView, PolicyContext, ScoredPolicy
from zoomr.kvstore.schedule import BufferSchedule

from .sequence import position_ranges

PREFILL_ROOM = 512  # cells a sequence may hold beyond the policy's bound while a prompt is prefilled (tokens)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model shapes the scoring needs: layers, query heads, KV heads, head size (elements)."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int


def _no_events(_event) -> None:
    return None


@contextlib.contextmanager
def one_torch_thread():
    """Run the block with torch on one intra-op thread. A token's scoring is small, and torch's thread pool
    would otherwise contend for the cores with llama.cpp's own (spinning) threads: with ``-t 1`` on a 2-core
    host, h2o decoded at a third of its one-thread speed (``benchmarks/llamacpp_speed.py`` measures it)."""
    old = torch.get_num_threads()
    if old != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if old != 1:
            torch.set_num_threads(old)


class ScoredCells:
    """One sequence's score-ranked policy on llama.cpp (see the module docstring).

    Args:
        config: the policy's config (H2O, SnapKV, R-KV or KeyDiff); its ``selection`` must be None or
            ``shared``.
        room: cells allowed beyond the policy's bound while a prompt is prefilled (tokens); a longer prompt is
            prefilled in chunks, each scored and cut to the budget before the next.
    Raises:
        ValueError: ``--selection per-head`` (cells cannot follow it), or knobs the policy refuses.

    :meth:`bind` attaches it to the model's shapes before the first forward.
    Attributes:
        cap: the policy's bound before any prompt (``budget + slack``) + room: the most cells the sequence holds
            (tokens).
    """

    evicts = True
    wants_text = False
    wants_kq = True     # the engine captures each forward's queries and keys for it (KQCapture)
    shifts = False      # evicted cells leave holes; positions stay as written

    def __init__(self, config: PolicyConfig, room: int = PREFILL_ROOM):
        if getattr(config, "selection", None) not in (None, "shared"):
            raise ValueError(f"--selection {config.selection}: the llamacpp backend evicts whole KV cells, one "
                             "position for every layer and head, so it runs the shared selection only (use "
                             "--backend torch for per-head)")
        policy = dataclasses.replace(config, selection="shared").build()
        if not isinstance(policy, ScoredPolicy):
            raise TypeError(f"{type(policy).__name__} is not a score-ranked policy")
        self.policy, self.name = policy, policy.name
        self.cap = policy.bound_tokens + room
        schedule = getattr(policy, "schedule", None)   # R-KV, SnapKV: compress when the cells fill, off-schedule
        if isinstance(schedule, BufferSchedule):
            schedule.hard_cap = self.cap
        self.keys: torch.Tensor | None = None                  # [L·Hkv, n, d] keys of the resident cells
        self.positions = torch.empty(0, dtype=torch.long)      # [n] their positions, ascending
        self._kq: tuple[list[np.ndarray], list[np.ndarray]] | None = None
        self._keep: torch.Tensor | None = None                 # the last selection's positions, until evicted

    @property
    def bound(self) -> int:
        """The most cells a decode step attends (tokens): the policy's ``bound_tokens``, which for R-KV grows
        with the prompt once it was seen (at most ``cap``)."""
        return self.policy.bound_tokens

    def bind(self, shapes: Shapes) -> None:
        """Attach to a loaded model (once, before the first forward)."""
        L, H, Hkv, d = shapes.n_layer, shapes.n_head, shapes.n_head_kv, shapes.head_dim
        self.policy.bind(PolicyContext(1, L * H, L * Hkv, d, torch.device("cpu"), None, _no_events))
        self.keys = torch.empty(L * Hkv, 0, d)

    def take_kq(self, q: list[np.ndarray], k: list[np.ndarray]) -> None:
        """This forward's queries and keys, for the next :meth:`observe`: per layer [T, H, d] and [T, Hkv, d]."""
        self._kq = q, k

    def observe(self, start: int, ids: list[int], text: str) -> bool:
        """Score the forward of ``ids`` at positions ``start …``; True when the policy cut the cells (to evict now).

        Raises:
            RuntimeError: no queries/keys were handed over for this forward.
        """
        if self._kq is None:
            raise RuntimeError("ScoredCells.observe without the forward's queries and keys (take_kq)")
        (q_layers, k_layers), self._kq = self._kq, None
        T = len(ids)
        q = heads_first(q_layers)                                   # [L·H, T, d]
        k = heads_first(k_layers)                                   # [L·Hkv, T, d]
        keys = torch.cat([self.keys, k], dim=1)
        positions = torch.cat([self.positions, torch.arange(start, start + T)])
        rows = positions.expand(keys.shape[0], -1)
        self.policy.observe(LayerView(0, q, keys, rows, T, start))
        selection = self.policy.end_forward(ForwardInfo(start, ids, text, start == 0))
        if selection is None:
            self.keys, self.positions = keys, positions
            return False
        keep = selection[0]
        index = torch.searchsorted(positions, keep)
        self.keys, self.positions, self._keep = keys[:, index], keep.clone(), keep
        return True

    def evict(self, resident: list[int]) -> list[tuple[int, int]]:
        """The resident positions the last selection left out, as ranges; [] when there was none (the engine
        then reports a full context: the policy always cuts before its cap)."""
        if self._keep is None:
            return []
        kept = set(self._keep.tolist())
        self._keep = None
        return position_ranges([p for p in resident if p not in kept])

    def fork(self) -> "ScoredCells":
        """An independent copy: the key shadow is shared (replaced, never written in place), the policy forked."""
        other = object.__new__(ScoredCells)
        other.__dict__.update(self.__dict__)
        other.policy = self.policy.fork(self.policy.ctx)
        return other

    def describe(self) -> str:
        """The policy's description, e.g. ``h2o(B=64, heavy=32, recent=32, shared)``."""
        return self.policy.describe()

    def stats(self) -> dict:
        """The policy's own counters."""
        return self.policy.stats()

    def state_bytes(self) -> int:
        """Host bytes beside llama.cpp's cells: the key shadow plus the policy's state (scores, query window)."""
        return self.keys.numel() * self.keys.element_size() + self.policy.state_bytes()


def heads_first(layers: list[np.ndarray]) -> torch.Tensor:
    """Per-layer [T, heads, d] arrays → [L·heads, T, d], layer-major (layer l's head h at row l·heads + h)."""
    x = torch.from_numpy(np.stack(layers))               # [L, T, heads, d]
    L, T, heads, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(L * heads, T, d)
