"""A compact functional decoder for the Llama / Qwen2 / Qwen3 / SmolLM2 family.

Pre-norm transformer: RMSNorm → attention (GQA, optional q/k/v bias, optional per-head q/k RMSNorm, RoPE)
→ residual → RMSNorm → SwiGLU MLP → residual; final RMSNorm; LM head (tied or not). Attention reads its
keys and values through a :class:`zoomr.kvstore.base.KVCache`, which is where KV policies plug in.

Source: the HF ``transformers`` Llama, Qwen2 and Qwen3 modelling code (architecture facts only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from zoomr.kvstore.base import KVCache

from .cascade import attend_shared_prefix, shared_prefix_groups
from .config import ModelConfig
from .ggml_decode import DecodeGraph, RowAttention, attends_in_ggml
from .ggml_layers import GgmlEmbedding, GgmlHead, GgmlLayer, GgmlLinear, Heads, rope_divisors
from .head import EXACT_TOP_K, ExactTopHead
from .quant import DenseLinear, GroupQuant, Int4Linear, Int8Linear, Linear, QuantEmbedding, check_quant, make_linear
from .rope import RotaryTable, apply_rotary, inv_frequencies

# forward_batch's attention modes; auto is per_seq (see Decoder.forward_batch)
ATTENTION_MODES = ("auto", "per_seq", "padded", "cascade")


def default_kv_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV-cache / attention dtype when none is asked for: the compute dtype on CUDA, float32 on a CPU.

    A CPU without native half-precision dot products (AVX2, no AVX512-BF16/AMX) runs decode attention over
    bf16 or fp16 keys several times slower than over fp32 ones (4-10x measured on an AVX2 CPU with
    SmolLM2-135M's 9 query / 3 KV heads), and attention grows with the context while the weights do not;
    the price is 4 bytes an element of KV cache instead of 2.
    """
    return dtype if device.type == "cuda" else torch.float32


def attend_parts(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention over keys/values held in several parts, without concatenating them.

    The scores of every part are computed and normalized together, then each part's values are
    weighted by its share, so a fork reads its shared prefix in place (see
    :class:`zoomr.kvstore.base.FullKVCache`); the result equals attention over the parts concatenated.

    Args:
        q: [H, T, d] queries; H a multiple of Hkv (grouped-query: head h reads KV head h // (H / Hkv)).
        parts: [(K_i, V_i)], each [Hkv, n_i, d], in position order.
        mask: None or [T, N] bool (True = attend), N = Σ n_i.
    Returns:
        [H, T, d] in q's dtype.
    """
    H, T, d = q.shape
    Hkv = parts[0][0].shape[0]
    g = H // Hkv
    qg = q.reshape(Hkv, g * T, d) * d ** -0.5          # rows: (group member, token) per KV head
    scores = [torch.bmm(qg, K.transpose(1, 2)) for K, _ in parts]
    scores = (scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)).float()   # [Hkv, g*T, N]
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
    p = scores.softmax(dim=-1).to(q.dtype)
    out, start = None, 0
    for K, V in parts:
        n = K.shape[1]
        term = torch.bmm(p[..., start:start + n], V)
        out, start = term if out is None else out + term, start + n
    return out.reshape(H, T, d)


@dataclass(frozen=True)
class LayerShape:
    """What a layer's math needs besides its weights: query and KV heads, head size d, RMSNorm epsilon, and the
    dtypes of the linears and of attention."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    dtype: torch.dtype      # the linears' compute dtype
    kv_dtype: torch.dtype   # queries, keys, values, RoPE


def attn_in(x: torch.Tensor, L: "_Layer", cos: torch.Tensor, sin: torch.Tensor,
            shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to attention: RMSNorm, fused QKV projection, the per-head q/k RMSNorm where the layer has
    one (Qwen3, ``L.qk_norm``), RoPE on q and k.

    Args:
        x: [S, hidden] float32 residual stream; cos, sin: [S, d] from :class:`RotaryTable`.
    Returns:
        q [H, S, d], k [Hkv, S, d], v [Hkv, S, d] in ``shape.kv_dtype``.
    """
    h = F.rms_norm(x, (x.shape[-1],), L.attn_norm, shape.eps).to(shape.dtype)
    return qkv_heads(L.qkv(h).to(shape.kv_dtype), L, cos, sin, shape)


def qkv_heads(qkv: torch.Tensor, L: "_Layer", cos: torch.Tensor, sin: torch.Tensor,
              shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [S, (H + 2·Hkv)·d] (in ``shape.kv_dtype``) split into heads, with the
    per-head q/k RMSNorm where the layer has one and RoPE on q and k: q [H, S, d], k [Hkv, S, d], v [Hkv, S, d]."""
    H, Hkv, d, S = shape.n_heads, shape.n_kv_heads, shape.head_dim, qkv.shape[0]
    qk = qkv[:, :(H + Hkv) * d].view(S, H + Hkv, d)
    if L.qk_norm is not None:
        # normalized in fp32 whatever the KV dtype, as transformers' Qwen3RMSNorm does; q and k heads in one
        # call, each head's row of the stacked weight being its q or k norm
        qk = (F.rms_norm(qk.float(), (d,), None, shape.eps) * L.qk_norm).to(shape.kv_dtype)
    # q and k rotate together: one rotation per layer instead of two
    qk = apply_rotary(qk.transpose(0, 1), cos, sin)
    v = qkv[:, (H + Hkv) * d:].view(S, Hkv, d).transpose(0, 1)
    return qk[:H], qk[H:], v


def attn_out_mlp(x: torch.Tensor, o: torch.Tensor, L: "_Layer", shape: LayerShape) -> torch.Tensor:
    """A layer after attention: output projection and residual, RMSNorm, SwiGLU MLP and residual.

    Args:
        x: [S, hidden] float32 residual stream (not modified); o: [S, H * d] attention output in ``shape.dtype``.
    Returns:
        the new [S, hidden] float32 residual stream.
    """
    x = x + L.o(o)
    h = F.rms_norm(x, (x.shape[-1],), L.mlp_norm, shape.eps).to(shape.dtype)
    # SiLU(gate)·up in fp32 whatever the compute dtype: rounding that product to bf16 alone cost the int4
    # path 3 of 512 top-1 agreements with llama.cpp (0.9766 → 0.9824 once in fp32), for two casts a layer
    gate, up = L.gate_up(h).float().chunk(2, dim=-1)
    return x + L.down((F.silu(gate) * up).to(shape.dtype))


_EAGER = (attn_in, attn_out_mlp)


class _CompiledOrEager:
    """``torch.compile(fn)``, falling back to ``fn`` itself for good if compiling fails (a missing or broken C++
    toolchain, an op inductor cannot lower): ``fn`` has no side effects, so the call is simply run again
    eagerly. The functions compiled together share ``state``: one warning line on stderr for all of them, and
    after one fails the others run eagerly too (``state["failed"]``)."""

    def __init__(self, fn, state: dict):
        self.eager, self.fn, self.state = fn, torch.compile(fn, fullgraph=True), state

    def __call__(self, *args):
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._inductor.exc import InductorError

        if self.state["failed"]:
            return self.eager(*args)
        try:
            return self.fn(*args)
        except (BackendCompilerFailed, InductorError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"zoomr: warning: --compile failed ({first[:160]}); decoding eagerly", file=sys.stderr)
            self.state["failed"] = True
            return self.eager(*args)


def compiled_blocks() -> tuple:
    """:func:`attn_in` and :func:`attn_out_mlp` through ``torch.compile`` (inductor, whole graphs).

    Every layer shares the two graphs (the weights are graph inputs, not constants), so the first decode step
    compiles two graphs, not one per layer, and a second row count recompiles them once with a dynamic one
    (:class:`~zoomr.backends.torch.engine.TorchBackend` runs both at load).
    Attention stays eager between them: it reads each sequence's own KV policy. On a CPU inductor builds C++
    kernels (:func:`check_compile` looks for a compiler first). Measured on a 2-core AVX512 CPU (SmolLM2-135M,
    int4, ``benchmarks/backend_speed.py --rows int4,int4c``) the compiled steps decoded slower than eager ones
    (docs/backends.md "torch.compile"), hence opt-in (``--compile``); on CUDA the fused elementwise kernels are what it
    is for (not measured yet).

    Source: ``torch.compile`` (PyTorch 2 inductor); compiling the model's math but not the cache bookkeeping
    follows gpt-fast and nano-vllm.
    """
    state = {"failed": False}
    return (_CompiledOrEager(attn_in, state), _CompiledOrEager(attn_out_mlp, state))


def check_compile(device: torch.device) -> None:
    """``--compile`` can work here: on a CPU, inductor needs a C++ compiler (``$CXX``, else g++, clang++ or c++).

    Raises:
        ValueError: a CPU device and no C++ compiler on the PATH.
    """
    if device.type != "cpu":
        return
    cxx = os.environ.get("CXX")
    if not any(shutil.which(c) for c in ([cxx] if cxx else []) + ["g++", "clang++", "c++"]):
        raise ValueError("--compile on a CPU needs a C++ compiler (torch.compile builds C++ kernels) and none "
                         "was found: install g++ or set CXX, or run without --compile")


@dataclass
class _Layer:
    attn_norm: torch.Tensor   # [hidden]
    qkv: Linear               # hidden → (H + 2*Hkv) * d, bias included (Qwen2)
    o: Linear                 # H * d → hidden
    mlp_norm: torch.Tensor    # [hidden]
    gate_up: Linear           # hidden → 2 * ffn
    down: Linear              # ffn → hidden
    qk_norm: torch.Tensor | None = None   # [H + Hkv, d] float32: q_norm on the H query rows, k_norm on the Hkv (Qwen3)
    ggml: GgmlLayer | None = None          # --quant ggml: the layer's dense part as ggml graphs


class Decoder:
    """Inference-only decoder with fused QKV and gate/up projections.

    Args:
        cfg: architecture.
        tensors: weights under HF names (see ``weights.py``): float numpy arrays, or
            :class:`~zoomr.backends.torch.quant.GroupQuant` for GGUF blocks kept quantized.
        device: torch device.
        dtype: compute dtype (float32, bfloat16, float16).
        quant: ``--quant`` mode, resolved (``auto`` keeps blocks as int4 and floats dense; ``none``, ``int8``,
            ``int4``: see :func:`~zoomr.backends.torch.quant.make_linear`; ``ggml``: every 2-D tensor a
            :class:`~zoomr.backends.torch.ggml_layers.RawWeight`, the layers' dense part in ggml graphs, fp32).
        kv_dtype: dtype of the KV cache and of attention (queries, keys, values, RoPE); None:
            :func:`default_kv_dtype`. The linears always run in ``dtype``.
        compile: decode steps run :func:`compiled_blocks` (``--compile``; compiled at their first call).
    Raises:
        ValueError: ``compile`` on a CPU without a C++ compiler (:func:`check_compile`).
    """

    def __init__(self, cfg: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype,
                 quant: str = "none", kv_dtype: torch.dtype | None = None, compile: bool = False):
        self.cfg, self.device, self.dtype, self.quant = cfg, device, dtype, check_quant(quant)
        self.kv_dtype = kv_dtype or default_kv_dtype(device, dtype)
        self._shape = LayerShape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps, dtype, self.kv_dtype)
        # decode steps (one new token per sequence) run the compiled layer math; prefill stays eager, as its
        # row count changes with every prompt
        if compile:
            check_compile(device)
        self._blocks = compiled_blocks() if compile else _EAGER

        def t(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
            w = tensors[name]
            w = w.dequantize() if isinstance(w, GroupQuant) else w
            return torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dt)

        def norm(name: str) -> torch.Tensor:  # norms run on the fp32 residual stream
            return t(name, torch.float32)

        ggml = quant == "ggml"
        threads = torch.get_num_threads()

        def lin(names: list[str], bias: list[str] | None = None, fuse: bool = True) -> Linear:
            b = np.concatenate([np.asarray(tensors[n], np.float32) for n in bias]) if bias else None
            if ggml:
                return GgmlLinear([tensors[n] for n in names], b, threads, fuse=fuse)
            return make_linear([tensors[n] for n in names], b, quant, device, dtype)

        emb = tensors["model.embed_tokens.weight"]
        if ggml:
            self.embed = GgmlEmbedding(emb, threads)
        elif isinstance(emb, GroupQuant) and quant != "none":
            self.embed = QuantEmbedding(emb, device)  # exact rows, a quarter (Q8_0) of fp32's bytes
        else:
            self.embed = t("model.embed_tokens.weight")
        if ggml:   # a tied head reads the embedding's own bytes: one table in memory
            head = tensors["model.embed_tokens.weight" if cfg.tied_embeddings else "lm_head.weight"]
            self.lm_head = GgmlLinear([head], None, threads)
        elif cfg.tied_embeddings and isinstance(self.embed, torch.Tensor) and (
                quant == "none" or (quant == "auto" and not isinstance(emb, GroupQuant))):
            self.lm_head = DenseLinear.sharing(self.embed)  # one table for lookup and head
        else:
            name = "model.embed_tokens.weight" if cfg.tied_embeddings else "lm_head.weight"
            # a float head quantized to int4 at load loses too much (SmolLM2-135M: top-1 vs llama.cpp 0.89,
            # KL 0.037 nats; per-row int8 0.973 / 0.0049): under --quant int4 it gets int8
            head_mode = "int8" if quant == "int4" and not isinstance(tensors[name], GroupQuant) else quant
            self.lm_head = make_linear([tensors[name]], None, head_mode, device, dtype)
            if isinstance(tensors[name], GroupQuant) and (quant == "w8a8" or (
                    dtype != torch.float32 and isinstance(self.lm_head, (Int4Linear, Int8Linear)))):
                # half-precision kernels round the logits (w8a8 rounds the activations, in any dtype); the
                # ones decoding looks at are recomputed exactly
                tied = cfg.tied_embeddings and isinstance(self.embed, QuantEmbedding)
                table = self.embed if tied else QuantEmbedding(tensors[name], device)
                self.lm_head = ExactTopHead(self.lm_head, table, EXACT_TOP_K, dtype, shares_table=tied)
        self.norm = norm("model.norm.weight")
        self.layers: list[_Layer] = []

        def qk_norm(a: str) -> torch.Tensor | None:
            if not cfg.qk_norm:
                return None
            q, k = norm(a + "q_norm.weight"), norm(a + "k_norm.weight")
            return torch.cat([q.expand(cfg.n_heads, -1), k.expand(cfg.n_kv_heads, -1)]).contiguous()

        freq = tensors.get("rope_freqs")
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                              torch.from_numpy(np.asarray(freq, np.float32)) if freq is not None else None)
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            L = _Layer(
                attn_norm=norm(p + "input_layernorm.weight"),
                qkv=lin([a + f"{x}_proj.weight" for x in "qkv"],
                        [a + f"{x}_proj.bias" for x in "qkv"] if cfg.attn_bias else None),
                o=lin([a + "o_proj.weight"]),
                mlp_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=lin([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], fuse=not ggml),
                down=lin([p + "mlp.down_proj.weight"]),
                qk_norm=qk_norm(a),
            )
            if ggml:
                heads = Heads(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta,
                              rope_divisors(inv.numpy(), cfg.rope_theta),
                              None if L.qk_norm is None else L.qk_norm.numpy(), cfg.rms_eps)
                L.ggml = GgmlLayer(L.qkv, L.o, L.gate_up, L.down, tensors[p + "input_layernorm.weight"],
                                   tensors[p + "post_attention_layernorm.weight"], cfg.rms_eps, heads, threads)
            self.layers.append(L)
        self._ggml_head = self._ggml_step = self._row_attention = None
        if ggml:
            for a, b in zip(self.layers, self.layers[1:]):
                a.ggml.next = b.ggml
            self._ggml_head = GgmlHead(tensors["model.norm.weight"], cfg.rms_eps, self.lm_head, threads)
            self._ggml_step = DecodeGraph(self.embed, [L.ggml for L in self.layers], self._ggml_head, threads)
            self._row_attention = RowAttention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, threads)
        # held in the attention dtype: the rotation then costs no cast per forward (angles computed in float64)
        self.rope = RotaryTable(inv, device, self.kv_dtype, n=min(cfg.max_ctx, 8192))

    @contextlib.contextmanager
    def first_layers(self, n: int):
        """Within the block, the model is its first ``n`` layers, embedding and head (a cut-down model whose step
        time :mod:`.quant_probe` measures)."""
        saved = self.layers, self._ggml_step
        self.layers = self.layers[:n]
        if saved[1] is not None:
            self._ggml_step = DecodeGraph(self.embed, [L.ggml for L in self.layers], self._ggml_head,
                                          saved[1].n_threads)
        try:
            yield self
        finally:
            self.layers, self._ggml_step = saved

    @property
    def compiled(self) -> bool:
        """Decode steps run compiled graphs: ``compile`` was asked for and compiling has not failed."""
        return self._blocks is not _EAGER and not self._blocks[0].state["failed"]

    def linears(self) -> list[Linear]:
        """Every linear of the model, LM head last."""
        return [x for L in self.layers for x in (L.qkv, L.o, L.gate_up, L.down)] + [self.lm_head]

    def weight_bytes(self) -> int:
        """Bytes of all weights as held on the device (a tied table counted once per form it is held in)."""
        total = sum(x.nbytes() for x in self.linears())
        tensors = [self.norm] + [w for L in self.layers for w in (L.attn_norm, L.mlp_norm, L.qk_norm) if w is not None]
        if isinstance(self.embed, GgmlEmbedding):
            # a tied table is the head's bytes too, already counted there
            total += 0 if self.cfg.tied_embeddings else self.embed.nbytes()
        elif isinstance(self.embed, QuantEmbedding):
            total += self.embed.nbytes()
        elif not (isinstance(self.lm_head, DenseLinear) and self.lm_head.w is self.embed):
            tensors.append(self.embed)
        return total + sum(w.numel() * w.element_size() for w in tensors)

    def weight_summary(self) -> str:
        """How the linears are held, e.g. ``int4 (Q4_K)/int4×2 (Q6_K regrouped), head int4×2 (Q8_0)``: one entry
        per form and source type (a linear's ``kind`` lists its own, '/'-separated)."""
        body = sorted({k for x in self.linears()[:-1] for k in x.kind.split("/")})
        return f"{'/'.join(body)}, head {self.lm_head.kind}"

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # the final norm (the layers' own are in attn_in / attn_out_mlp): x is the fp32 residual stream, the
        # result in the compute dtype the head takes
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_eps).to(self.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                all_logits: bool = False, return_hidden: bool = False) -> torch.Tensor:
        """Run T tokens of one sequence through the model, appending their K/V to ``cache``
        (:meth:`forward_batch` with one sequence).

        Args:
            ids: [T] int64 token ids.
            positions: [T] int64 absolute positions (RoPE).
            cache: the sequence's KV cache; ``cache.update`` returns the keys/values to attend.
            all_logits: return logits for all T positions instead of the last one.
            return_hidden: return the final-norm hidden states instead of logits (for other heads,
                e.g. a process reward model's score head).
        Returns:
            float32 logits, [vocab] or [T, vocab]; with ``return_hidden``, [hidden] or [T, hidden].
        """
        out = self.forward_batch(ids, positions, [ids.shape[0]], [cache], all_logits=all_logits,
                                 return_hidden=return_hidden)
        return out if all_logits else out[0]

    @torch.inference_mode()
    def forward_batch(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], caches: list[KVCache],
                      all_logits: bool = False, attention: str = "auto", return_hidden: bool = False) -> torch.Tensor:
        """Run B sequences' new tokens, packed, through the model; each sequence reads its own cache.

        Norms, projections, MLP and LM head run once over all S = Σ lengths rows; attention runs per
        sequence over what its own cache (its own policy and selection) answers, so caches of different
        lengths and selections mix freely in one forward.

        Args:
            ids: [S] int64 token ids; sequence b owns ``lengths[b]`` consecutive rows, in batch order.
            positions: [S] int64 absolute positions (RoPE), each sequence's continuing its cache.
            lengths: B ≥ 1 token counts, each ≥ 1.
            caches: B distinct caches; ``caches[b].update`` is called once per layer with sequence b's rows.
            all_logits: logits of every row [S, vocab] instead of each sequence's last row [B, vocab].
            attention: ``per_seq`` (one SDPA call per sequence: each row's logits are bitwise those of
                the sequence run alone, whatever else is in the batch), ``padded`` (decode only: every
                length 1; the B attended sets zero-padded to the longest and masked, one SDPA call),
                ``cascade`` (decode: forks whose caches hand back the same frozen parts, such as the
                forks of one prompt, attend them as one group,
                :func:`zoomr.backends.torch.cascade.attend_shared_prefix`; other rows as ``per_seq``), or
                ``auto`` (``per_seq``). ``padded`` and ``cascade`` run other kernels over other shapes, so
                their logits equal ``per_seq``'s to rounding, not bitwise (tested at 1e-4 and 2.5e-4 in
                fp32; with bf16 linears the cascade's rounding changed a greedy token by the sixth step),
                which is why neither is the default: a batch must not change what a sequence generates.
                On a 2-core CPU ``per_seq`` and ``padded`` were equal within the run-to-run noise at batch
                1-16, and ``cascade`` gains where many forks share a long prompt
                (benchmarks/batch_throughput.py --attention per_seq cascade --shared-prompt); not measured
                on CUDA yet.
            return_hidden: the final-norm hidden states ([B or S, hidden]) instead of logits.
        Returns:
            float32 logits on the model's device, [B, vocab] (or [S, vocab] with ``all_logits``).
        Raises:
            ValueError: ``padded`` with a sequence of more than one new token, or an unknown mode.
        """
        cfg = self.cfg
        S = ids.shape[0]
        H, Hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if attention == "auto":
            attention = "per_seq"
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention mode {attention!r} unknown (choose from {', '.join(ATTENTION_MODES)})")
        if attention == "padded" and S != len(lengths):
            raise ValueError("padded attention decodes one token per sequence; prefill uses per_seq")
        bounds, s0 = [], 0
        for n in lengths:
            bounds.append((s0, s0 + n))
            s0 += n
        ggml = self._ggml_step is not None
        if (ggml and S == len(lengths) and attention == "per_seq" and not return_hidden
                and all(attends_in_ggml(c) for c in caches)):   # a token per full-KV cache: one ggml graph
            return self._ggml_step.step(ids, positions, caches)
        # the residual stream stays fp32 whatever the compute dtype: summing 60 layer outputs into a bf16
        # stream is what costs a bf16 model its agreement with llama.cpp (whose stream is fp32), for 2 KiB a token
        x = self.embed[ids].float()
        shape = self._shape
        if ggml:   # RoPE inside the graphs, at these positions
            pos32 = positions.to(torch.int32)

            def attn_in(x, L):
                return tuple(t.to(shape.kv_dtype) for t in L.ggml.norm_qkv(x, pos32))

            def attn_out_mlp(x, o, L):
                return L.ggml.out_mlp(x, o, pos32)
        else:
            cos, sin = self.rope.get(positions)
            # compiled blocks serve decode only (one row a sequence)
            block_in, block_out = self._blocks if S == len(lengths) else _EAGER

            def attn_in(x, L):
                return block_in(x, L, cos, sin, shape)

            def attn_out_mlp(x, o, L):
                return block_out(x, o, L, shape)
        o = torch.empty(S, H * d, device=x.device, dtype=self.dtype)
        masks: dict[tuple[int, int], torch.Tensor] = {}  # layers attending the same N share one causal mask
        for li, L in enumerate(self.layers):
            q, k, v = attn_in(x, L)                                          # [H, S, d], [Hkv, S, d] x2
            if attention == "padded":
                self._attend_padded(li, q, k, v, caches, o)
            else:
                parts_all = []
                for (a, b), cache in zip(bounds, caches):
                    update_parts = getattr(cache, "update_parts", None)
                    if update_parts is None:
                        parts_all.append([cache.update(li, q[:, a:b], k[:, a:b], v[:, a:b])])
                    else:
                        parts_all.append(update_parts(li, q[:, a:b], k[:, a:b], v[:, a:b]))
                done = set()
                if attention == "cascade" and S == len(lengths):   # decode: forks of one prefix as a group
                    for rows in shared_prefix_groups(parts_all):
                        ob = attend_shared_prefix(q[:, rows], parts_all[rows[0]][:-1], [parts_all[r][-1] for r in rows])
                        # index_put does not cast: the group's rows come back in the attention dtype
                        # (fp32 KV beside bf16 linears on a CPU), o is in the linears' dtype
                        o[rows] = ob.transpose(0, 1).reshape(len(rows), H * d).to(o.dtype)
                        done.update(rows)
                if ggml:
                    # the one-graph step's kernel, every such row in one graph: a plain full cache's row as alone,
                    # and a policy that keeps every position attends exactly as full KV does
                    # (several blocks only for a full cache's fork: a policy's parts stay with torch's merge)
                    rows = [r for r, ((a, b), parts) in enumerate(zip(bounds, parts_all))
                            if r not in done and b - a == 1 and all(RowAttention.takes(*p) for p in parts)
                            and (len(parts) == 1 or attends_in_ggml(caches[r]))]
                    if rows:
                        at = [bounds[r][0] for r in rows]
                        outs = self._row_attention.rows(q[:, at].transpose(0, 1), [parts_all[r] for r in rows])
                        o[at] = torch.stack(outs).to(o.dtype)
                        done.update(rows)
                for row, ((a, b), parts) in enumerate(zip(bounds, parts_all)):
                    if row in done:
                        continue
                    T, N = b - a, sum(K.shape[1] for K, _ in parts)
                    mask = None
                    if T > 1:
                        # the T new tokens are the last T of the N attended: causal within them
                        mask = masks.get((T, N))
                        if mask is None:
                            mask = masks[(T, N)] = torch.ones(T, N, dtype=torch.bool, device=x.device).tril(N - T)
                    if len(parts) == 1:
                        K, V = parts[0]
                        ob = F.scaled_dot_product_attention(q[None, :, a:b], K[None], V[None], attn_mask=mask,
                                                            enable_gqa=H != Hkv)[0]
                    else:
                        ob = attend_parts(q[:, a:b], parts, mask)
                    o[a:b] = ob.transpose(0, 1).reshape(T, H * d)
            x = attn_out_mlp(x, o, L)
        if not all_logits:
            x = x[[b - 1 for _, b in bounds]] if len(bounds) > 1 else x[-1:]
        if ggml and not return_hidden:   # final norm and head in the graph the one-graph decode step ends with
            return self._ggml_head(x)
        if isinstance(self.lm_head, ExactTopHead) and not return_hidden:   # it re-scores from the fp32 states
            return self.lm_head(F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_eps))
        h = self._rms(x, self.norm)
        return (h if return_hidden else self.lm_head(h)).float()

    def _attend_padded(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[KVCache],
                       out: torch.Tensor) -> None:
        """One new token per sequence: the B attended sets zero-padded to the longest, masked, one SDPA.

        q [H, B, d], k/v [Hkv, B, d]; writes out [B, H * d]."""
        H, B, d = q.shape
        kv = [cache.update(li, q[:, b:b + 1], k[:, b:b + 1], v[:, b:b + 1]) for b, cache in enumerate(caches)]
        n = [K.shape[1] for K, _ in kv]
        Kp = q.new_zeros(B, k.shape[0], max(n), d)
        Vp = torch.zeros_like(Kp)
        for b, (K, V) in enumerate(kv):
            Kp[b, :, :n[b]] = K
            Vp[b, :, :n[b]] = V
        mask = torch.arange(max(n), device=q.device)[None, :] < torch.tensor(n, device=q.device)[:, None]
        ob = F.scaled_dot_product_attention(q.transpose(0, 1)[:, :, None], Kp, Vp, attn_mask=mask[:, None, None],
                                            enable_gqa=H != k.shape[0])                 # [B, H, 1, d]
        out.copy_(ob.reshape(B, H * d))
