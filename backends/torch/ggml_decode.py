"""``--quant ggml`` decode steps over a full KV cache as whole ggml graphs, llama.cpp's way.

Between :class:`~zoomr.backends.torch.ggml_layers.GgmlLayer`'s graphs, a decode step crosses into Python
twice a layer (RoPE'd q/k/v out, attention, the attention output back in), which cost a 135M model about a
fifth of its decode time on a 2-core CPU. Where a sequence's cache is a
:class:`~zoomr.kvstore.base.FullKVCache` (no policy selects or evicts anything), attention needs nothing from
Python: this module runs the whole token in one graph, embedding to logits, the new keys and values copied into
the cache's own buffers inside it.

Attention reads the cache where it lies (:class:`_Attention`): a plain cache's positions are one block, attended
by ggml's ``flash_attn_ext``; a fork's are the frozen parts it shares, then its own, attended as blocks (scores
per block, one softmax, values per block), nothing copied. :class:`RowAttention` runs the same ops for the rows
of a batched forward, so a sequence gets the same bits decoded alone (through :class:`DecodeGraph`) or beside
others (through the per-layer graphs).

Per step the graph is re-pointed, not rebuilt: each block is an external tensor whose ``data`` is set to the
buffer's address (the write position included), and the views' lengths and strides to the positions attended.
A graph serves one own-buffer capacity and one set of shared parts; a cache that doubles, or a new fork, gets a
new graph (a few ms).

Source: llama.cpp's ``llm_build_llama`` / ``llm_build_qwen3`` graphs and its KV-cache views (``src/llama-kv-cache``).
"""

from __future__ import annotations

import math

import torch

from zoomr.kvstore.base import FullKVCache

from .ggml_layers import GgmlEmbedding, GgmlHead, GgmlLayer, GraphCache, rotated_qk
from .ggml_ops import TYPE_I32, Builder, Graph


def attends_in_ggml(cache) -> bool:
    """A one-token step over ``cache`` can be one :class:`DecodeGraph`: a full cache (not a subclass: a policy's
    or a scoring fork's) of fp32 CPU buffers, its own positions and any frozen parts it shares with forks."""
    return (type(cache) is FullKVCache and cache.dtype == torch.float32 and cache.device.type == "cpu"
            and all(_takes(k, v) for k, v in cache.parts[0]))


def _takes(k: torch.Tensor, v: torch.Tensor) -> bool:
    # what ggml's kernel reads: float32 CPU tensors [Hkv, n, d] with contiguous rows (any head/position strides)
    return (k.dtype == v.dtype == torch.float32 and k.device.type == v.device.type == "cpu"
            and k.shape == v.shape and k.stride(2) == v.stride(2) == 1)


def _plan_length(n: int) -> int:
    # graphs planned for this many attended positions (powers of two from 256): a few graphs serve every length
    return max(256, 1 << (n - 1).bit_length())


class _Attention:
    """One new token's attention over one or more blocks of K/V positions, in position order, as graph ops.

    One block (a plain cache, a policy's selection): ggml's ``flash_attn_ext`` over it. Several (a fork: the
    frozen parts it shares, then its own positions): per block the scores ``K·q`` (``mul_mat``), one softmax over
    all of them, per block the values weighted by theirs (``out_prod``), summed: no block is copied. Every block
    is an external root seen through a view whose strides (and, for the last, length) are written per run.

    The blocks' lengths are the graph's: all but the last exactly (a fork's parts do not change), the last
    planned (the most positions a run may attend there; work and scratch are sized for it).

    Args:
        b: the graph builder; q: the query, ggml (d, 1, H); heads: (H, Hkv, d); lengths: see above.
    Attributes:
        out: the attention output, ggml (H·d, 1); result: the op computing it (a graph output: 3-D, H·d values).
    """

    def __init__(self, b: Builder, q: int, heads: tuple[int, int, int], lengths: tuple[int, ...]):
        H, Hkv, d = heads
        scale = 1.0 / math.sqrt(d)
        self.lengths = lengths
        self.roots = [[b.external((d, n, Hkv)) for n in lengths] for _ in range(2)]
        self.views = [[b.view3(r, (d, n, Hkv), d * 4, n * d * 4) for r, n in zip(rs, lengths)] for rs in self.roots]
        self._last: list[tuple] = []   # (ne of a tensor, dim, positions before the last block): set per run
        # per block, K and V: the root's data, the view's ne and nb (written at every run) and what was written
        self._handles = [[(Graph.handles(r)[0], *Graph.handles(v)[1:]) for r, v in zip(rs, vs)]
                         for rs, vs in zip(self.roots, self.views)]
        # the (K, V) pairs the last run pointed at: a fork's shared parts are the same objects step after step
        # (held, so an identity check cannot meet a recycled object)
        self._pointed: list = [None] * len(lengths)
        if len(lengths) == 1:
            self.result = b.flash_attn(q, self.views[0][0], self.views[1][0], scale)
            self.out = b.reshape(self.result, H * d, 1)
            return
        q = b.cont(q)   # one layout for a decode step's q and a batch row's: the same kernel for both
        scores = [b.mul_mat(k, q) for k in self.views[0]]                 # (n_i, 1, H) each
        joined = scores[0]
        for t in scores[1:]:
            joined = b.concat(joined, t, 0)
        probs = b.soft_max(joined, scale)
        total, before = sum(lengths), sum(lengths[:-1])
        by_position = b.reshape(probs, 1, total, H)
        out, at = None, 0
        for v, n in zip(self.views[1], lengths):
            weights = b.view3(by_position, (1, n, H), 4, total * 4, at * 4)
            part = b.out_prod(v, weights)                                 # (d, 1, H)
            out = part if out is None else b.add(out, part)
            at += n
        self.result, self.out = out, b.reshape(out, H * d, 1)
        # what follows the last block's length (rows stay at the planned strides)
        follow = ((scores[-1], 0, 0), (joined, 0, before), (probs, 0, before), (weights, 1, 0))
        self._last = [(Graph.handles(t)[1], dim, n) for t, dim, n in follow]

    def point(self, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Aim at ``blocks`` ([(K, V)], each [Hkv, n_i, d], :func:`_takes`): the graph's lengths, the last one's
        at most planned.

        Raises:
            RuntimeError: blocks of other lengths than the graph's.
        """
        n = blocks[-1][0].shape[1]
        if (len(blocks) != len(self.lengths) or n > self.lengths[-1]
                or any(k.shape[1] != m for (k, _), m in zip(blocks[:-1], self.lengths))):
            raise RuntimeError(f"K/V blocks of {[k.shape[1] for k, _ in blocks]} positions under a graph for "
                               f"{list(self.lengths)}")
        for i, pair in enumerate(blocks):
            if pair is self._pointed[i]:   # a fork's shared part, as the last run left it
                continue
            self._pointed[i] = pair
            for t, (data, ne, nb) in zip(pair, (self._handles[0][i], self._handles[1][i])):
                data.value = t.data_ptr()
                ne[1] = t.shape[1]
                nb[1], nb[2] = t.stride(1) * 4, t.stride(0) * 4
                nb[3] = nb[2] * t.shape[0]
        for ne, dim, before in self._last:
            ne[dim] = before + n


def _lengths(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    # a graph's block lengths (see _Attention): the fixed blocks exactly, the last one planned
    return (*(k.shape[1] for k, _ in blocks[:-1]), _plan_length(blocks[-1][0].shape[1]))


class RowAttention:
    """Attention of one new token over its cache's blocks with ggml's kernel, for rows of a batched or per-layer
    forward (see the module docstring): the one-graph decode step's ops, so a full cache's row (a fork's too)
    gets the same bits either way, and a policy that evicts nothing attends exactly as full KV does. A batch's
    rows run in one graph (one flash attention op each: the same kernel on the same shapes as a row alone).

    Args:
        n_heads, n_kv_heads, head_dim: H, Hkv, d; n_threads: ggml threads.
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, n_threads: int):
        self.H, self.Hkv, self.d, self.n_threads = n_heads, n_kv_heads, head_dim, n_threads
        self._graphs = GraphCache(self._build)

    def _build(self, plans: tuple[tuple[int, ...], ...]):
        b = Builder(16 + sum(8 + 12 * len(p) for p in plans))
        H, Hkv, d = self.H, self.Hkv, self.d
        q = b.input("q", len(plans), H * d)
        outs, rows = {}, []
        for i, lengths in enumerate(plans):
            att = _Attention(b, b.view3(q, (d, 1, H), H * d * 4, d * 4, i * H * d * 4), (H, Hkv, d), lengths)
            outs[f"o{i}"] = (att.result, 3)
            rows.append(att)
        return b.finish(outs, self.n_threads), rows

    takes = staticmethod(_takes)

    def rows(self, q: torch.Tensor, blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
        """Row i's query q[i] ([B, H, d] float32, rotated) attending every position of its own ``blocks[i]``
        ([(K, V)] in position order, each [Hkv, n, d], :meth:`takes`), all in one graph → B tensors [H·d] float32."""
        graph, rows = self._graphs(tuple(_lengths(bl) for bl in blocks))

        def point():
            for att, bl in zip(rows, blocks):
                att.point(bl)

        out = graph.run(point, q=q.reshape(q.shape[0], -1).contiguous())
        return [out[f"o{i}"].view(-1) for i in range(len(blocks))]


class DecodeGraph:
    """A whole decode step of one or more sequences as one ggml graph: embedding, every layer with RoPE, each
    sequence's KV-cache write and attention, final RMSNorm and LM head; the projections run every row at once.

    Each row is computed on its own (8-bit activations per row, attention over its own cache), so a sequence's
    logits are the same bits in a step of one or of many.

    Args:
        embed: the token table; layers: the layers' graphs (weights, norms, heads); head: final RMSNorm and LM
            head; n_threads: ggml threads.
    """

    def __init__(self, embed: GgmlEmbedding, layers: list[GgmlLayer], head: GgmlHead, n_threads: int):
        self.embed, self.layers, self.head = embed, layers, head
        self.n_threads = n_threads
        self._graphs = GraphCache(self._build)

    def _build(self, key: tuple[tuple[int, tuple[int, ...]], ...]):
        B = len(key)
        # a layer makes about 50 graph tensors (more with biases, q/k norms, mixed weight types), a row's KV
        # writes and attention a dozen more per block
        b = Builder(64 + (64 + sum(16 + 12 * len(parts) for _, parts in key)) * len(self.layers))
        t = self.embed.table
        x = b.get_rows(b.weight(t.data, t.ggml_type, t.shape), b.input("ids", B, 1, TYPE_I32))
        pos = b.input("pos", B, 1, TYPE_I32)
        all_views = []
        for L in self.layers:
            heads = L.heads
            H, Hkv, d = heads.n_heads, heads.n_kv_heads, heads.head_dim
            n_qk, n_qkv = (H + Hkv) * d, (H + 2 * Hkv) * d
            qkv = L.qkv_product(b, x)
            qk = rotated_qk(b, qkv, B, heads, pos)
            rows, o = [], None
            for i, (cap, parts) in enumerate(key):
                # the new position's k and v, written into the cache's own buffers before the attention reads them
                roots = [b.external((d, cap, Hkv)) for _ in range(2)]
                writes = [b.view3(r, (d, 1, Hkv), d * 4, cap * d * 4) for r in roots]
                b.copy_into(b.view3(qk, (d, 1, Hkv), n_qk * 4, d * 4, i * n_qk * 4 + H * d * 4), writes[0])
                b.copy_into(b.view3(qkv, (d, 1, Hkv), n_qkv * 4, d * 4, i * n_qkv * 4 + n_qk * 4), writes[1])
                # the own buffer planned at its capacity: the work buffer is sized for the longest attention
                q = b.view3(qk, (d, 1, H), n_qk * 4, d * 4, i * n_qk * 4)
                att = _Attention(b, q, (H, Hkv, d), parts + (cap,))
                rows.append(([Graph.handles(r)[0] for r in roots], att))
                o = att.out if o is None else b.concat(o, att.out, 1)
            all_views.append(rows)
            x = L.mlp(b, x, o)
        logits = self.head.build(b, x)
        return b.finish({"logits": logits}, self.n_threads), all_views

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[FullKVCache]) -> torch.Tensor:
        """One step of B sequences: tokens, positions [B] int64 → logits [B, vocab] float32.

        Each cache is a full cache (:func:`attends_in_ggml`), grown here to hold its new position and written by
        the graph; their ``end_forward`` is the caller's, as after any forward.

        Raises:
            RuntimeError: buffers of another capacity than the graph's (its strides would miss their rows).
        """
        key = []
        for cache in caches:
            cache.reserve(cache.n_tokens + 1)
            key.append((cache.k[0].shape[1] if self.layers else 0, tuple(k.shape[1] for k, _ in cache.parts[0])))
        graph, all_views = self._graphs(tuple(key))

        def point():
            for li, rows in enumerate(all_views):
                for (writes, att), cache, (cap, _) in zip(rows, caches, key):
                    own = cache.n_tokens - cache.frozen
                    k, v = cache.k[li], cache.v[li]
                    if k.shape[1] != cap or v.shape[1] != cap:
                        raise RuntimeError(f"KV buffers of {k.shape[1]} positions under a graph built for {cap}")
                    row = own * k.shape[2] * 4
                    for data, buf in zip(writes, (k, v)):
                        data.value = buf.data_ptr() + row
                    att.point([*cache.parts[li], (k[:, :own + 1], v[:, :own + 1])])

        return graph.run(point, ids=tokens.to(torch.int32), pos=positions.to(torch.int32))["logits"]
