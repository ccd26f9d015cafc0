"""The KV-policy seam: what a policy sees of each forward and how it answers with a selection.

A policy never owns weights or storage. :class:`zoomr.kvstore.cache.PolicyKVCache` stores every K/V in the
host store, attends the active set, and asks the policy two questions:

* :meth:`KVPolicy.observe` once per layer per forward, with the new queries and the keys just attended
  (policies that score by attention — H2O, SnapKV, R-KV — answer here, per layer);
* :meth:`KVPolicy.end_forward` once per forward, with the tokens and their text (policies driven by
  text and segments — StreamingLLM, SumR, ZoomR — answer here, for every layer).

An answer is a *selection*: [Hkv, M] int64 positions, each row sorted ascending and unique, the same M
for every KV head. From the next forward on, that layer attends exactly those positions plus the
tokens appended since. ``None`` means "keep what is active and append". Positions are the original
ones (RoPE is never re-applied), so a policy may bring back any position ever written.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .events import RecomputeEvent
from .base import join_parts
from .host_store import HostKVStore
from .knobs import SELECTIONS
from .stats import storage_bytes


class LayerView:
    """One layer of one forward, as the policy sees it.

    The attended keys may come in several parts (a fork reads the resident set it shares with its parent
    in place, then its own positions): :attr:`key_parts` / :attr:`position_parts` are those parts as they
    are; :attr:`keys` / :attr:`positions` concatenate them on first read (held by this view only, which the
    cache drops after :meth:`KVPolicy.observe`), so a policy that does not read them pays nothing.

    Args:
        layer: layer index.
        q: [H, T, d] post-RoPE queries of the T new tokens.
        keys: [Hkv, N, d] post-RoPE keys attended by this forward (active set + the new tokens, last), or
            a list of parts [Hkv, n_i, d] in position order (Σ n_i = N).
        positions: [Hkv, N] int64 positions of ``keys`` (on the compute device), or a list of parts
            [Hkv, n_i] matching ``keys``.
        n_new: T.
        start: position of the first new token.
    """

    def __init__(self, layer: int, q: torch.Tensor, keys, positions, n_new: int, start: int):
        self.layer, self.q, self.n_new, self.start = layer, q, n_new, start
        self.key_parts: list[torch.Tensor] = list(keys) if isinstance(keys, (list, tuple)) else [keys]
        self.position_parts: list[torch.Tensor] = (list(positions) if isinstance(positions, (list, tuple))
                                                   else [positions])
        self._keys: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    @property
    def n_attended(self) -> int:
        """N, the positions attended (tokens), without concatenating anything."""
        return sum(p.shape[1] for p in self.position_parts)

    @property
    def keys(self) -> torch.Tensor:
        """[Hkv, N, d]: the key parts concatenated (a view when there is one part)."""
        if self._keys is None:
            self._keys = join_parts([(k,) for k in self.key_parts])[0]
        return self._keys

    @property
    def positions(self) -> torch.Tensor:
        """[Hkv, N] int64: the position parts concatenated (a view when there is one part)."""
        if self._positions is None:
            self._positions = join_parts([(p,) for p in self.position_parts])[0]
        return self._positions


@dataclass
class ForwardInfo:
    """One finished forward. ``is_prompt`` is True for the sequence's first forward (the prompt)."""

    start: int
    token_ids: list[int]
    text: str
    is_prompt: bool

    @property
    def end(self) -> int:
        """Positions written after this forward (tokens)."""
        return self.start + len(self.token_ids)


@dataclass
class PolicyContext:
    """Shapes and services a policy may use.

    Attributes:
        n_layers, n_heads, n_kv_heads, head_dim: model shapes (H query heads share Hkv KV heads).
        device: compute device (where scores are computed).
        store: the host store (read keys of any written position, e.g. for mean keys).
        emit: publish a :class:`RecomputeEvent`.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    device: torch.device
    store: HostKVStore
    emit: Callable[[RecomputeEvent], None]

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads


class KVPolicy:
    """Base of every KV policy: keeps everything (override :meth:`observe` / :meth:`end_forward`).

    Attributes:
        name: the ``--policy`` name.
        budget: B, the positions a budgeted policy keeps after a compression (tokens); None when the
            policy is not budgeted (full, SumR, ZoomR: their active size follows from the text).
        slack: how far above B the attended set may grow between compressions (tokens), so a budgeted
            policy always attends at most ``budget + slack`` positions in a decode step.
    """

    name: ClassVar[str] = "base"
    # whether end_forward reads ForwardInfo.text (segment tracking): the backend detokenizes only for those
    needs_text: ClassVar[bool] = False
    # whether a position it dropped can be selected again (SumR, ZoomR): only then does its cache keep every
    # K/V in the host store; an eviction-only policy holds its active set and nothing else
    restores_evicted: ClassVar[bool] = False
    # whether it ever leaves a position out of the attended set: only one that never does (full) may stream
    # every position from the host each step (PolicyKVCache's offload="stream"), and only one that does can
    # be a KV-Rescue base
    evicts: ClassVar[bool] = True
    budget: int | None = None
    slack: int = 0

    @property
    def bound_tokens(self) -> int | None:
        """The most positions attended at a decode step once the context exceeds the budget (tokens):
        ``budget + slack``; None for unbudgeted policies (their peak is measured instead)."""
        return None if self.budget is None else self.budget + self.slack

    def bind(self, ctx: PolicyContext) -> None:
        """Attach to one cache (called once by the cache before the first forward)."""
        self.ctx = ctx

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """See one layer of a forward; optionally return that layer's next selection [Hkv, M]."""
        return None

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """See a finished forward; optionally return the next selection [Hkv, M] of every layer."""
        return None

    def stats(self) -> dict:
        """Policy numbers for ``KVStats.extra`` (JSON-ready)."""
        return {}

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors this policy keeps on the compute device between forwards (scores, mean keys, queries);
        none here (full, streaming, SumR keep positions only)."""
        return []

    def state_bytes(self) -> int:
        """Bytes of :meth:`state_tensors`' storages (bytes; one shared with a fork counts in each, as the
        fork's K/V parts do): what the policy costs beside the attended K/V, reported as
        ``policy_state_bytes`` and counted in ``device_kv_bytes`` and the saving
        (:class:`zoomr.kvstore.stats.KVStats`)."""
        return storage_bytes(self.state_tensors())

    def fork(self, ctx: PolicyContext) -> "KVPolicy":
        """This policy's state for a forked cache whose context is ``ctx``; independent from here on.

        The default deep-copies everything but the context (safe for any subclass). zoomr's policies
        override it to share what they never modify in place and copy the rest; a subclass that adds
        state it mutates in place must copy that state in its own override.
        """
        return copy.deepcopy(self, memo={id(self.ctx): ctx})

    def _fork_shallow(self, ctx: PolicyContext) -> "KVPolicy":
        # a copy sharing every attribute; callers replace the containers they mutate
        other = copy.copy(self)
        other.ctx = ctx
        return other

    def describe(self) -> str:
        """Short description with the knobs in force, e.g. ``h2o(B=64, recent=32)``."""
        return self.name



class ScoredPolicy(KVPolicy):
    """Base of the policies that rank positions by a score (H2O, SnapKV, R-KV, KeyDiff), in one of two
    :data:`SELECTIONS`:

    * ``per-head`` (the papers'): each layer and KV head keeps its own top positions, chosen in
      :meth:`KVPolicy.observe` as soon as the layer has run;
    * ``shared``: one set of positions for every layer and KV head. Each layer's scores are averaged over
      its KV heads as the layers run, and :meth:`end_forward` keeps the top positions by the mean over
      layers. This is the only selection a cache of whole cells can follow: a llama.cpp KV cell holds one
      position for every layer and head (:mod:`zoomr.backends.llamacpp.scored`), and running the torch
      backend in this mode is what its decisions are compared with.

    Subclasses compute their score and call :meth:`choose`; in ``shared`` mode every layer must present
    the same candidates (they do, since every layer then holds the same positions).

    Raises:
        ValueError: a ``selection`` not in :data:`SELECTIONS` (from :meth:`set_selection`).
    """

    selection = "per-head"

    def set_selection(self, selection: str | None) -> None:
        """Use ``selection`` (None: ``per-head``)."""
        selection = selection or "per-head"
        if selection not in SELECTIONS:
            raise ValueError(f"{self.name}: --selection {selection!r} unknown (choose from {', '.join(SELECTIONS)})")
        self.selection = selection
        self._votes: list[torch.Tensor] = []      # shared: each layer's [C] mean score over KV heads, this forward
        self._shared: tuple[torch.Tensor, int, torch.Tensor] | None = None   # candidates [C], k, always [W]

    def choose(self, scores: torch.Tensor, candidates: torch.Tensor, k: int, always: torch.Tensor
               ) -> torch.Tensor | None:
        """This layer's answer to :meth:`KVPolicy.observe`, given its scores (see :func:`keep_top` for the
        shapes): per-head, the selection [Hkv, k + W]; shared, None (the layer's vote is kept for
        :meth:`end_forward`)."""
        if self.selection == "per-head":
            return keep_top(scores, candidates, k, always)
        self._votes.append(scores.float().mean(dim=0))
        self._shared = candidates[0], k, always[0]
        return None

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """Shared: the top positions by the mean vote over the layers that voted, [Hkv, k + W] with the same
        row for every KV head; None when no layer voted (nothing to evict) or per-head."""
        if not self._votes:
            return None
        votes = torch.stack(self._votes).mean(dim=0)
        candidates, k, always = self._shared
        self._votes, self._shared = [], None
        keep = keep_top(votes[None], candidates[None], k, always[None])
        return keep.expand(self.ctx.n_kv_heads, -1)

    def _fork_shallow(self, ctx: PolicyContext) -> "KVPolicy":
        other = super()._fork_shallow(ctx)
        other._votes = []
        return other

    def describe_selection(self) -> str:
        """``", shared"`` in shared mode, else ``""``: the tail of :meth:`describe`."""
        return ", shared" if self.selection == "shared" else ""


def grouped(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[H, T, d] queries → [Hkv, G, T, d] float32, query head h in KV group h // G (GQA)."""
    H, T, d = q.shape
    return q.float().reshape(n_kv_heads, H // n_kv_heads, T, d)


def attention_probs(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor
                    ) -> torch.Tensor:
    """Causal softmax attention of queries over keys, per query head, in float32.

    Args:
        q: [Hkv, G, T, d] grouped queries; q_pos: [T] their positions.
        keys: [Hkv, N, d]; k_pos: [Hkv, N] their positions. Either may instead be a list of parts
            ([Hkv, n_i, d] and [Hkv, n_i], Σ n_i = N, see :class:`LayerView`): scored in place, as if
            concatenated.
    Returns:
        [Hkv, G, T, N] probabilities; a key later than its query gets 0.
    """
    d = q.shape[-1]
    key_parts = keys if isinstance(keys, (list, tuple)) else [keys]
    pos_parts = k_pos if isinstance(k_pos, (list, tuple)) else [k_pos]
    logits = []
    for K, pos in zip(key_parts, pos_parts, strict=True):
        future = pos[:, None, None, :] > q_pos.to(pos.device)[None, None, :, None]
        logits.append((torch.einsum("hgtd,hnd->hgtn", q, K.float()) / d ** 0.5).masked_fill(future, float("-inf")))
    return (logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)).softmax(dim=-1)


def received_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor,
                       block: int = 256) -> torch.Tensor:
    """Attention each key receives, summed over all queries and the query heads of its KV group.

    Same maths as summing :func:`attention_probs` over (G, T), computed ``block`` queries at a time so a
    long prefill never holds a [T, N] matrix per head (a 16K prompt would need gigabytes).

    Args:
        q: [Hkv, G, T, d]; q_pos: [T]; keys: [Hkv, N, d]; k_pos: [Hkv, N] (or lists of parts, as in
            :func:`attention_probs`).
    Returns:
        [Hkv, N] float32.
    """
    pos_parts = k_pos if isinstance(k_pos, (list, tuple)) else [k_pos]
    first = keys[0] if isinstance(keys, (list, tuple)) else keys
    total = torch.zeros(first.shape[0], sum(p.shape[1] for p in pos_parts), device=first.device)
    for i in range(0, q.shape[2], block):
        total += attention_probs(q[:, :, i:i + block], q_pos[i:i + block], keys, k_pos).sum(dim=(1, 2))
    return total


def keep_top(scores: torch.Tensor, candidates: torch.Tensor, k: int, always: torch.Tensor) -> torch.Tensor:
    """Per KV head: the ``k`` best-scored candidate positions plus ``always``, sorted.

    Args:
        scores: [Hkv, C] float; candidates: [Hkv, C] positions; always: [Hkv, W] positions kept anyway.
    Returns:
        [Hkv, k + W] int64 positions, rows sorted ascending.
    """
    top = candidates.gather(1, scores.topk(k, dim=1).indices)
    return torch.cat([top, always], dim=1).sort(dim=1).values


class QueryWindow:
    """The last ``size`` queries of each layer and their positions (SnapKV, R-KV observation window).

    :meth:`push` only records the new queries (a reference per forward, no tensor op): R-KV and SnapKV
    read the window once per compression, every ``buffer`` tokens, so the concatenation is made then
    (:meth:`window`), not at each of the 30 × B per-layer calls of a decode step.
    """

    def __init__(self, size: int):
        self.size = size
        self._chunks: dict[int, list[tuple[torch.Tensor, int]]] = {}   # layer → [(q [H, t, d], first position)]
        self._held: dict[int, int] = {}                                 # layer → Σ t over its chunks

    def push(self, view: LayerView) -> int:
        """Record ``view``'s queries; return how many the window holds for its layer now (≤ ``size``)."""
        q, start = view.q, view.start
        if q.shape[1] > self.size:  # a prefill: only its last queries can be in the window
            start += q.shape[1] - self.size
            q = q[:, -self.size:]
        if q.untyped_storage().nbytes() > q.nbytes:  # a view into a prefill's [H, T, d] queries (or a batch's)
            q = q.clone()                                # would keep all of them alive, and count as state
        chunks = self._chunks.setdefault(view.layer, [])
        chunks.append((q, start))
        held = self._held.get(view.layer, 0) + q.shape[1]
        while held - chunks[0][0].shape[1] >= self.size:   # the oldest chunk fell out of the window
            held -= chunks.pop(0)[0].shape[1]
        self._held[view.layer] = held
        return min(held, self.size)

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window of ``layer``: queries [H, W, d] float32 and their positions [W] int64, oldest first.

        Raises:
            KeyError: nothing was pushed for ``layer``.
        """
        chunks = self._chunks[layer]
        q = torch.cat([c for c, _ in chunks], dim=1)[:, -self.size:].float()
        device = q.device
        pos = torch.cat([torch.arange(p, p + c.shape[1], device=device) for c, p in chunks])[-self.size:]
        return q, pos

    def tensors(self) -> list[torch.Tensor]:
        """The recorded query chunks ([H, t, d] each, all layers): what the window holds on the device."""
        return [q for chunks in self._chunks.values() for q, _ in chunks]

    def copy(self) -> "QueryWindow":
        """An independent window sharing the recorded tensors (never written): O(layers × chunks)."""
        other = QueryWindow(self.size)
        other._chunks = {layer: list(c) for layer, c in self._chunks.items()}
        other._held = dict(self._held)
        return other
