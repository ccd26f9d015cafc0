"""``--quant ggml`` decode steps over a plain full KV cache as whole ggml graphs, llama.cpp's way.

Between :class:`~zoomr.backends.torch.ggml_layers.GgmlLayer`'s graphs, a decode step crosses into Python
twice a layer (RoPE'd q/k/v out, attention, the attention output back in), which cost a 135M model about a
fifth of its decode time on a 2-core CPU. Where a sequence's cache is a
:class:`~zoomr.kvstore.base.FullKVCache` holding its positions in its own buffers (no policy selects or evicts
anything, no fork shares a prefix), attention needs nothing from Python: this module runs the whole token in
one graph, embedding to logits, the new keys and values copied into the cache's buffers inside it.

The attention kernel is ggml's ``flash_attn_ext`` over the cache's fp32 buffers. :class:`RowAttention` is the same
kernel on the same views for one row of a batched forward, so a sequence gets the same bits decoded alone
(through :class:`DecodeGraph`) or beside others (through the per-layer graphs).

Per step the graph is re-pointed, not rebuilt: each layer's cache buffers are external tensors whose ``data``
is set to the buffers' addresses (the write position included), and the attended views' ``ne[1]`` to the
number of positions. A graph serves one buffer capacity; a cache that doubles gets a new graph.

Source: llama.cpp's ``llm_build_llama`` / ``llm_build_qwen3`` graphs and its KV-cache views (``src/llama-kv-cache``).
"""

from __future__ import annotations

import math

import torch

from zoomr.kvstore.base import FullKVCache

from .ggml_layers import GgmlEmbedding, GgmlHead, GgmlLayer, GraphCache, rotated_qk
from .ggml_ops import TYPE_I32, Builder, Graph


def attends_in_ggml(cache) -> bool:
    """A one-token step over ``cache`` can be one :class:`DecodeGraph`: a plain full cache (not a subclass) of fp32
    CPU buffers, no parts shared with forks."""
    return (type(cache) is FullKVCache and cache.frozen == 0
            and cache.dtype == torch.float32 and cache.device.type == "cpu")


class _CacheViews:
    """One layer's K and V buffers as graph tensors: where the new position is written and what is attended.

    Shapes are ggml's: a buffer [Hkv, cap, d] is ne (d, cap, Hkv)."""

    def __init__(self, b: Builder, d: int, n_kv: int, cap: int):
        nb1, nb2 = d * 4, cap * d * 4
        self.cap = cap
        self.roots = [b.external((d, cap, n_kv)) for _ in range(4)]   # K write, V write, K read, V read
        self.write_k, self.write_v = (b.view3(r, (d, 1, n_kv), nb1, nb2) for r in self.roots[:2])
        # planned at the full capacity: the compute's work buffer is sized for the longest attention it may run
        self.read_k, self.read_v = (b.view3(r, (d, cap, n_kv), nb1, nb2) for r in self.roots[2:])

    def point(self, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """Aim at buffers ``k``, ``v`` ([Hkv, cap, d] float32) holding ``n`` positions; the step writes position n
        and attends n + 1.

        Raises:
            RuntimeError: buffers of another capacity than the graph's (its strides would miss their rows).
        """
        if k.shape[1] != self.cap or v.shape[1] != self.cap:
            raise RuntimeError(f"KV buffers of {k.shape[1]} positions under a graph built for {self.cap}")
        row = n * k.shape[2] * 4
        for root, ptr in zip(self.roots, (k.data_ptr() + row, v.data_ptr() + row, k.data_ptr(), v.data_ptr())):
            Graph.fields(root).data = ptr
        for t in (self.read_k, self.read_v):
            Graph.fields(t).ne[1] = n + 1


def _plan_length(n: int) -> int:
    # graphs planned for this many attended positions (powers of two from 256): a few graphs serve every length
    return max(256, 1 << (n - 1).bit_length())


class RowAttention:
    """Attention of one new token over one (K, V) pair with ggml's kernel, for rows of a batched or per-layer
    forward (see the module docstring): the one-graph decode step's kernel, so a plain full cache's row gets the
    same bits either way, and a policy that evicts nothing attends exactly as full KV does. A batch's rows run
    in one graph (one flash attention op each: the same kernel on the same shapes as a row alone).

    Args:
        n_heads, n_kv_heads, head_dim: H, Hkv, d; n_threads: ggml threads.
    """

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, n_threads: int):
        self.H, self.Hkv, self.d, self.n_threads = n_heads, n_kv_heads, head_dim, n_threads
        self._graphs = GraphCache(self._build)

    def _build(self, lengths: tuple[int, ...]):
        b = Builder(16 * len(lengths) + 16)
        H, Hkv, d = self.H, self.Hkv, self.d
        q = b.input("q", len(lengths), H * d)
        outs, rows = {}, []
        for i, length in enumerate(lengths):
            qi = b.view3(q, (d, 1, H), H * d * 4, d * 4, i * H * d * 4)
            roots = [b.external((d, length, Hkv)) for _ in range(2)]
            k, v = (b.view3(r, (d, length, Hkv), d * 4, length * d * 4) for r in roots)
            outs[f"o{i}"] = b.flash_attn(qi, k, v, 1.0 / math.sqrt(d))
            rows.append((roots, (k, v)))
        return b.finish(outs, self.n_threads), rows

    @staticmethod
    def takes(k: torch.Tensor, v: torch.Tensor) -> bool:
        """``k`` and ``v`` ([Hkv, n, d]) are float32 CPU tensors whose rows are contiguous (any head and position
        strides): what the kernel reads."""
        return (k.dtype == v.dtype == torch.float32 and k.device.type == v.device.type == "cpu"
                and k.shape == v.shape and k.stride(2) == v.stride(2) == 1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [H, d] float32 (rotated) attending every position of k, v [Hkv, n, d] (:meth:`takes`) → [H·d] float32."""
        return self.rows(q[None], [(k, v)])[0]

    def rows(self, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Row i's query q[i] ([B, H, d] float32, rotated) attending every position of its own ``kv[i]`` (k, v
        [Hkv, n_i, d], :meth:`takes`), all in one graph → B tensors [H·d] float32."""
        graph, rows = self._graphs(tuple(_plan_length(k.shape[1]) for k, _ in kv))

        def point():
            for (roots, views), pair in zip(rows, kv):
                for root, view, t in zip(roots, views, pair):
                    Graph.fields(root).data = t.data_ptr()
                    f = Graph.fields(view)
                    f.ne[1] = t.shape[1]
                    f.nb[1], f.nb[2] = t.stride(1) * 4, t.stride(0) * 4
                    f.nb[3] = f.nb[2] * t.shape[0]

        out = graph.run(point, q=q.reshape(q.shape[0], -1).contiguous())
        return [out[f"o{i}"].view(-1) for i in range(len(kv))]


class DecodeGraph:
    """A whole decode step of one sequence as one ggml graph: embedding, every layer with RoPE, the KV-cache write
    and attention, final RMSNorm and LM head.

    Args:
        embed: the token table; layers: the layers' graphs (weights, norms, heads); head: final RMSNorm and LM
            head; n_threads: ggml threads.
    """

    def __init__(self, embed: GgmlEmbedding, layers: list[GgmlLayer], head: GgmlHead, n_threads: int):
        self.embed, self.layers, self.head = embed, layers, head
        self.n_threads = n_threads
        self._graphs = GraphCache(self._build)

    def _build(self, cap: int):
        # a layer makes about 50 graph tensors (more with biases, q/k norms, mixed weight types)
        b = Builder(64 + 64 * len(self.layers))
        t = self.embed.table
        x = b.get_rows(b.weight(t.data, t.ggml_type, t.shape), b.input("ids", 1, 1, TYPE_I32))
        pos = b.input("pos", 1, 1, TYPE_I32)
        all_views = []
        for L in self.layers:
            heads = L.heads
            H, Hkv, d = heads.n_heads, heads.n_kv_heads, heads.head_dim
            qkv = L.qkv_product(b, x)
            qk = rotated_qk(b, qkv, 1, heads, pos)
            views = _CacheViews(b, d, Hkv, cap)
            all_views.append(views)
            # the new position's k and v into the cache, before the attention that reads them
            b.copy_into(b.view3(qk, (d, 1, Hkv), (H + Hkv) * d * 4, d * 4, H * d * 4), views.write_k)
            n_qkv = (H + 2 * Hkv) * d
            b.copy_into(b.view3(qkv, (d, 1, Hkv), n_qkv * 4, d * 4, (H + Hkv) * d * 4), views.write_v)
            q = b.view3(qk, (d, 1, H), (H + Hkv) * d * 4, d * 4)
            o = b.reshape(b.flash_attn(q, views.read_k, views.read_v, 1.0 / math.sqrt(d)), H * d, 1)
            x = L.mlp(b, x, o)
        logits = self.head.build(b, x)
        return b.finish({"logits": logits}, self.n_threads), all_views

    def __call__(self, token: torch.Tensor, position: torch.Tensor, cache: FullKVCache) -> torch.Tensor:
        """One step: token, position [1] int64 → logits [1, vocab] float32.

        ``cache`` is a plain full cache (:func:`attends_in_ggml`), grown here to hold the new position and written by
        the graph; its ``end_forward`` is the caller's, as after any forward."""
        n = cache.n_tokens
        cache.reserve(n + 1)
        graph, all_views = self._graphs(cache.k[0].shape[1] if self.layers else 0)

        def point():
            for li, views in enumerate(all_views):
                views.point(cache.k[li], cache.v[li], n)

        return graph.run(point, ids=token.to(torch.int32), pos=position.to(torch.int32))["logits"]
