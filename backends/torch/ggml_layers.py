"""``--quant ggml``: the decoder's dense work in ggml's CPU kernels, on the GGUF's own blocks.

Per layer, two ggml graphs do everything but attention, the same ops in the same order as llama.cpp's graph:

- :meth:`GgmlLayer.norm_qkv`: RMSNorm × weight, the Q, K and V projections (+ bias), the per-head q/k RMSNorm
  (Qwen3) and RoPE, [S, hidden] → q [H, S, d], k and v [Hkv, S, d];
- :meth:`GgmlLayer.out_mlp`: the output projection and residual, RMSNorm × weight, ``silu(gate) · up``, the down
  projection and residual, [S, hidden] and [S, H·d] → [S, hidden] (and the next layer's q, k, v).

The KV cache and attention (where KV policies and ZoomR's selection act) stay in torch, between the two; a
decode step over a plain full cache runs as one graph instead (:mod:`.ggml_decode`). The token embedding is
ggml's ``get_rows``, the final RMSNorm and LM head a ggml graph (:class:`GgmlHead`). Weights are
the file's bytes (a llama file's Q/K rows reordered to rotate-half order, a copy of those two); each product
quantizes its activation rows to the weight type's dot-product partner (Q8_0, Q8_1, Q8_K) per row, so a row's
result does not depend on its batch-mates. Weights of a type that ggml's CPU backend repacks on this CPU (Q4_0,
Q4_K, IQ4_NL ...: rows interleaved for its GEMV/GEMM kernels) are copied into that layout once, as llama.cpp
loads them (:class:`~.ggml_ops.PackedWeight`); those kernels also quantize and sum each row on its own.
Activations and results are fp32.

Graphs are built per row count S and kept for the most recent few (decode's 1 and a batch size stay built).
Source: llama.cpp's ``llm_build_llama`` / ``llm_build_qwen3`` graphs (``src/models``), ggml's ops.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .ggml_ops import TYPE_F32, TYPE_I32, Builder, Graph, PackedWeight

_KEEP_SHAPES = 4   # row counts whose graphs stay built (decode 1, a batch size, the last prefill lengths)


@dataclass
class RawWeight:
    """A 2-D GGUF tensor as the file stores it.

    Attributes:
        data: [N, row_bytes] uint8, C-contiguous: each row's blocks.
        ggml_type: ggml's type id (gguf's ``GGMLQuantizationType``); type_name: its name (``Q4_1`` ...).
        shape: (N, K) in weights.
    """

    data: np.ndarray
    ggml_type: int
    type_name: str
    shape: tuple[int, int]

    def take_rows(self, order: np.ndarray) -> "RawWeight":
        """The same weight with rows reordered (``order``: [N] row indices): whole rows of blocks move."""
        return RawWeight(np.ascontiguousarray(self.data[order]), self.ggml_type, self.type_name, self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], through gguf's reference dequantization."""
        import gguf

        return gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.ggml_type)).reshape(self.shape)

    @staticmethod
    def concat(parts: list["RawWeight"]) -> "RawWeight":
        """Rows of ``parts`` stacked; all of one type and K.

        Raises:
            ValueError: parts of different types or widths.
        """
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("cannot stack GGUF tensors of different types or widths")
        return RawWeight(np.ascontiguousarray(np.concatenate([p.data for p in parts])), first.ggml_type,
                         first.type_name, (sum(p.shape[0] for p in parts), first.shape[1]))


def _runs(parts: list[RawWeight]) -> list[RawWeight]:
    """Consecutive parts of one type stacked into one weight each (fused QKV or gate/up: usually one)."""
    runs: list[list[RawWeight]] = []
    for p in parts:
        if runs and runs[-1][0].ggml_type == p.ggml_type:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else RawWeight.concat(r) for r in runs]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


class GraphCache:
    """Built graphs by a key (a row count, a KV-buffer capacity), the most recent few kept; ``build(key)`` makes one."""

    def __init__(self, build):
        self._build, self._graphs = build, OrderedDict()

    def __call__(self, key: int):
        """The graph (whatever ``build`` returns) for ``key``, built on first use."""
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._build(key)
            while len(self._graphs) > _KEEP_SHAPES:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return g


class GgmlLinear:
    """``x @ wᵀ (+ b)`` with ggml's ``mul_mat`` on a GGUF tensor's blocks (one product per run of alike types).

    Args:
        parts: row blocks stacked in order (fused QKV: Q, K, V), all with the same K.
        bias: [ΣN] float32 or None.
        n_threads: ggml threads (the backend's ``-t``).
        fuse: stack alike parts into one product (QKV); False keeps one product per part (gate and up, which
            the SwiGLU reads apart).
    """

    def __init__(self, parts: list[RawWeight], bias: np.ndarray | None, n_threads: int, fuse: bool = True):
        self.parts = _runs(parts) if fuse else list(parts)
        self.bias = None if bias is None else _f32(bias)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        # repacked once here (types this CPU has an interleaved layout for), shared by every graph built later
        self.packed = [PackedWeight.of(p.data, p.ggml_type, p.shape) for p in self.parts]
        self.kind = "/".join(sorted({f"ggml ({p.type_name}{' repacked' if pk else ''})"
                                     for p, pk in zip(self.parts, self.packed)}))
        self.n_threads = n_threads
        self._graphs = GraphCache(self._build)

    def project(self, b: Builder, x: int) -> list[int]:
        """The products of ``x`` (a graph tensor [S, K]) with each run, bias added: [S, N_run] each."""
        outs, row = [], 0
        for p, pk in zip(self.parts, self.packed):
            y = b.mul_mat(pk.tensor if pk else b.weight(p.data, p.ggml_type, p.shape), x)
            if self.bias is not None:
                y = b.add(y, b.weight(self.bias[row:row + p.shape[0]], TYPE_F32, (p.shape[0],)))
            outs.append(y)
            row += p.shape[0]
        return outs

    def _build(self, rows: int) -> Graph:
        b = Builder()
        outs = self.project(b, b.input("x", rows, self.shape[1]))
        return b.finish({f"y{i}": y for i, y in enumerate(outs)}, self.n_threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, K] → [S, N] float32."""
        x = x.float().contiguous()
        ys = self._graphs(x.shape[0]).run(x=x)
        return ys["y0"] if len(ys) == 1 else torch.cat(list(ys.values()), dim=-1)

    def nbytes(self) -> int:
        """Bytes the products read: the file's blocks, or their repacked copy (plus the bias)."""
        return (sum(pk.nbytes if pk else p.data.nbytes for p, pk in zip(self.parts, self.packed))
                + (0 if self.bias is None else self.bias.nbytes))


@dataclass(frozen=True)
class Heads:
    """What the ggml graphs need to split the fused QKV product into heads and rotate q and k.

    Attributes:
        n_heads, n_kv_heads, head_dim: H, Hkv, d.
        rope_base: RoPE θ; freq_factors: [d/2] float32 divisors of each pair's frequency (RoPE scalings and GGUF
            ``rope_freqs`` folded into one, see :func:`rope_divisors`) or None.
        qk_norm: [H + Hkv, d] float32 per-head q/k RMSNorm weights (Qwen3) or None; eps: their epsilon.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    freq_factors: np.ndarray | None = None
    qk_norm: np.ndarray | None = None
    eps: float = 1e-6


def rope_divisors(inv_freq: np.ndarray, base: float) -> np.ndarray | None:
    """ggml's ``freq_factors`` for a model whose pair i turns at ``inv_freq[i]`` (float64 [d/2]): ggml turns pair
    i at ``base^(-2i/d) / freq_factors[i]``. None where the two agree (plain RoPE: ggml's own arithmetic)."""
    d = 2 * len(inv_freq)
    plain = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ratio = plain / inv_freq
    return None if np.allclose(ratio, 1.0, rtol=0, atol=1e-12) else ratio.astype(np.float32)


def rotated_qk(b: Builder, qkv: int, rows: int, heads: Heads, pos: int) -> int:
    """The fused QKV product (ggml (n_qkv, S)) → q and k rotated, ggml (d, H + Hkv, S): the per-head RMSNorm
    where the model has one, then RoPE, as llama.cpp's graph does."""
    H, Hkv, d = heads.n_heads, heads.n_kv_heads, heads.head_dim
    qk = b.view3(b.reshape(qkv, d, H + 2 * Hkv, rows), (d, H + Hkv, rows), d * 4, (H + 2 * Hkv) * d * 4)
    if heads.qk_norm is not None:
        qk = b.rms_norm(qk, b.weight(heads.qk_norm, TYPE_F32, heads.qk_norm.shape), heads.eps)
    ff = heads.freq_factors
    return b.rope(qk, pos, None if ff is None else b.weight(ff, TYPE_F32, ff.shape), d, heads.rope_base)


class GgmlLayer:
    """One decoder layer's dense part in two ggml graphs (see the module docstring).

    Args:
        qkv, o, down: the projections (:class:`GgmlLinear`); gate_up: gate and up, unfused (two products);
        attn_norm, mlp_norm: [hidden] float32; eps: RMSNorm epsilon; heads: head split and RoPE;
        n_threads: ggml threads.
    """

    def __init__(self, qkv: GgmlLinear, o: GgmlLinear, gate_up: GgmlLinear, down: GgmlLinear,
                 attn_norm: np.ndarray, mlp_norm: np.ndarray, eps: float, heads: Heads, n_threads: int):
        if len(gate_up.parts) != 2:
            raise ValueError("the ggml layer takes gate and up as two separate products")
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.attn_norm, self.mlp_norm, self.eps, self.n_threads = _f32(attn_norm), _f32(mlp_norm), eps, n_threads
        self.heads = heads
        self.hidden = o.shape[0]
        # the next layer: its RMSNorm and QKV join this layer's out_mlp graph (one ggml call per layer, not two)
        self.next: GgmlLayer | None = None
        self._pending: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None   # (residual, its QKV), from the last
        self._in = GraphCache(self._build_in)
        self._out = GraphCache(self._build_out)

    def _norm(self, b: Builder, x: int, w: np.ndarray) -> int:
        return b.rms_norm(x, b.weight(w, TYPE_F32, w.shape), self.eps)

    def qkv_product(self, b: Builder, x: int) -> int:
        """The graph's ops from the residual ``x`` (ggml (hidden, S)) to the fused QKV product (n_qkv, S)."""
        ys = self.qkv.project(b, self._norm(b, x, self.attn_norm))
        qkv = ys[0]
        for y in ys[1:]:   # Q, K and V of different types (a K-quant mix): one product each, joined
            qkv = b.concat(qkv, y)
        return qkv

    def _qkv(self, b: Builder, x: int, pos: int, rows: int) -> dict:
        qkv = self.qkv_product(b, x)
        return {"qkv": qkv, "qk": (rotated_qk(b, qkv, rows, self.heads, pos), 3)}

    def _build_in(self, rows: int) -> Graph:
        b = Builder()
        return b.finish(self._qkv(b, b.input("x", rows, self.hidden), b.input("pos", rows, 1, TYPE_I32), rows),
                        self.n_threads)

    def mlp(self, b: Builder, x: int, o: int) -> int:
        """The graph's ops from the attention output ``o`` (ggml (H·d, S)) and residual ``x`` to the next residual."""
        h = b.add(x, self._one(self.o.project(b, o)))
        n = self._norm(b, h, self.mlp_norm)
        gate, up = self.gate_up.project(b, n)
        return b.add(h, self._one(self.down.project(b, b.mul(b.silu(gate), up))))

    def _build_out(self, rows: int) -> Graph:
        b = Builder(96)
        out = self.mlp(b, b.input("x", rows, self.hidden), b.input("o", rows, self.o.shape[1]))
        nxt = {} if self.next is None else self.next._qkv(b, out, b.input("pos", rows, 1, TYPE_I32), rows)
        return b.finish({"x": out, **nxt}, self.n_threads)

    @staticmethod
    def _one(ys: list[int]) -> int:
        if len(ys) != 1:   # the o/gate/up/down projections are single GGUF tensors: one type each
            raise ValueError("a single-tensor projection gave several products")
        return ys[0]

    def _split(self, ys: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H, Hkv, d = self.heads.n_heads, self.heads.n_kv_heads, self.heads.head_dim
        qk = ys["qk"].transpose(0, 1)
        S = qk.shape[1]
        return qk[:H], qk[H:], ys["qkv"][:, (H + Hkv) * d:].view(S, Hkv, d).transpose(0, 1)

    def norm_qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [S, hidden] float32 residual, pos [S] int32 positions → q [H, S, d], k [Hkv, S, d] (rotated) and
        v [Hkv, S, d], float32. Where the layer before computed them with its :meth:`out_mlp` from this very
        ``x``, those are returned."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is x:
            return self._split(pending[1])
        return self._split(self._in(x.shape[0]).run(x=x.contiguous(), pos=pos))

    def out_mlp(self, x: torch.Tensor, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [S, hidden] residual, o [S, H·d] attention output (float32), pos [S] int32 → the next residual
        [S, hidden]; the next layer's q, k, v of it are computed in the same graph and handed to that layer's
        :meth:`norm_qkv`."""
        inputs = {"x": x.contiguous(), "o": o.float().contiguous()}
        if self.next is not None:
            inputs["pos"] = pos
        ys = self._out(x.shape[0]).run(**inputs)
        out = ys.pop("x")
        if self.next is not None:
            self.next._pending = (out, ys)
        return out


class GgmlHead:
    """The final RMSNorm and the LM head in one ggml graph: residual [S, hidden] → logits [S, vocab] float32.

    Args:
        norm: [hidden] float32 RMSNorm weight; eps: its epsilon; head: the LM head's product; n_threads: ggml threads.
    """

    def __init__(self, norm: np.ndarray, eps: float, head: GgmlLinear, n_threads: int):
        self.norm, self.eps, self.head, self.n_threads = _f32(norm), eps, head, n_threads
        self._graphs = GraphCache(self._build)

    def build(self, b: Builder, x: int) -> int:
        """The graph's ops from the residual ``x`` (ggml (hidden, S)) to the logits (vocab, S)."""
        return GgmlLayer._one(self.head.project(b, b.rms_norm(x, b.weight(self.norm, TYPE_F32, self.norm.shape),
                                                                self.eps)))

    def _build(self, rows: int) -> Graph:
        b = Builder()
        return b.finish({"logits": self.build(b, b.input("x", rows, self.norm.shape[0]))}, self.n_threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, hidden] float32 residual → [S, vocab] float32 logits."""
        return self._graphs(x.shape[0]).run(x=x.contiguous())["logits"]


class GgmlEmbedding:
    """Token rows looked up from the file's table with ggml's ``get_rows`` (dequantized exactly, fp32).

    Args:
        table: [V, hidden] GGUF tensor; n_threads: ggml threads.
    """

    def __init__(self, table: RawWeight, n_threads: int):
        self.table, self.n_threads = table, n_threads
        self._graphs = GraphCache(self._build)

    def _build(self, rows: int) -> Graph:
        b = Builder()
        t = self.table
        out = b.get_rows(b.weight(t.data, t.ggml_type, t.shape), b.input("ids", rows, 1, TYPE_I32))
        return b.finish({"rows": out}, self.n_threads)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 → [T, hidden] float32."""
        return self._graphs(ids.shape[0]).run(ids=ids.to(torch.int32).contiguous())["rows"]

    def nbytes(self) -> int:
        """The table's bytes as the file holds them."""
        return self.table.data.nbytes
