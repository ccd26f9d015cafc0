"""A compact functional decoder for the Llama / Qwen2 / SmolLM2 family.

Pre-norm transformer: RMSNorm → attention (GQA, RoPE, optional q/k/v bias) → residual →
RMSNorm → SwiGLU MLP → residual; final RMSNorm; LM head (tied or not). Attention reads its keys
and values through a :class:`zoomr.kvstore.base.KVCache`, which is where KV policies plug in.

Source: the HF ``transformers`` Llama and Qwen2 modelling code (architecture facts only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from zoomr.kvstore.base import KVCache

from .config import ModelConfig
from .rope import RotaryTable, apply_rotary, inv_frequencies


@dataclass
class _Layer:
    attn_norm: torch.Tensor   # [hidden]
    wqkv: torch.Tensor        # [(H + 2*Hkv) * d, hidden]
    bqkv: torch.Tensor | None  # [(H + 2*Hkv) * d]
    wo: torch.Tensor          # [hidden, H * d]
    mlp_norm: torch.Tensor    # [hidden]
    w_gate_up: torch.Tensor   # [2 * ffn, hidden]
    w_down: torch.Tensor      # [hidden, ffn]


class Decoder:
    """Inference-only decoder with fused QKV and gate/up projections.

    Args:
        cfg: architecture.
        tensors: float32 numpy weights under HF names (see ``weights.py``).
        device: torch device.
        dtype: compute dtype (float32, bfloat16, float16).
    """

    def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray], device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(tensors[name])).to(device=device, dtype=dtype)

        self.embed = t("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tied_embeddings else t("lm_head.weight")
        self.norm = t("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.attn_bias:
                bias = torch.cat([t(a + f"{x}_proj.bias") for x in "qkv"])
            self.layers.append(_Layer(
                attn_norm=t(p + "input_layernorm.weight"),
                wqkv=torch.cat([t(a + f"{x}_proj.weight") for x in "qkv"]),
                bqkv=bias,
                wo=t(a + "o_proj.weight"),
                mlp_norm=t(p + "post_attention_layernorm.weight"),
                w_gate_up=torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]),
                w_down=t(p + "mlp.down_proj.weight"),
            ))
        freq = tensors.get("rope_freqs")
        inv = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                              torch.from_numpy(freq) if freq is not None else None)
        self.rope = RotaryTable(inv, device, torch.float32, n=min(cfg.max_ctx, 8192))
        self._upcast_gemm = device.type == "cpu" and dtype != torch.float32
        self._split = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)

    def weight_bytes(self) -> int:
        """Bytes of all weights as held on the device (tied embeddings counted once)."""
        seen, total = set(), 0
        for w in [self.embed, self.lm_head, self.norm] + [x for l in self.layers for x in vars(l).values()]:
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                total += w.numel() * w.element_size()
        return total

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        # CPUs without bf16 arithmetic run bf16 GEMMs ~4x slower than fp32, while a one-row decode GEMV is
        # memory-bound and gains from bf16's half-size weights: upcast only for many-row (prefill) GEMMs.
        if self._upcast_gemm and x.shape[0] > 8:
            return F.linear(x.float(), w.float(), None if b is None else b.float()).to(self.dtype)
        return F.linear(x, w, b)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(self.dtype) * w

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                all_logits: bool = False, return_hidden: bool = False) -> torch.Tensor:
        """Run T tokens through the model, appending their K/V to ``cache``.

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
        cfg = self.cfg
        T = ids.shape[0]
        H, Hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = self.embed[ids]
        cos, sin = self.rope.get(positions)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        for li, L in enumerate(self.layers):
            h = self._rms(x, L.attn_norm)
            qkv = self._linear(h, L.wqkv, L.bqkv)
            q, k, v = qkv.split(self._split, dim=-1)
            q = apply_rotary(q.view(T, H, d).transpose(0, 1), cos, sin)
            k = apply_rotary(k.view(T, Hkv, d).transpose(0, 1), cos, sin)
            v = v.view(T, Hkv, d).transpose(0, 1)
            K, V = cache.update(li, q, k, v)
            N = K.shape[1]
            mask = None
            if T > 1:
                # the T new tokens are the last T of the N attended: causal within them
                mask = torch.ones(T, N, dtype=torch.bool, device=x.device).tril(diagonal=N - T)
            o = F.scaled_dot_product_attention(q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0),
                                               attn_mask=mask, enable_gqa=H != Hkv)
            x = x + self._linear(o[0].transpose(0, 1).reshape(T, H * d), L.wo)
            h = self._rms(x, L.mlp_norm)
            gate, up = self._linear(h, L.w_gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, L.w_down)
        if not all_logits:
            x = x[-1:]
        h = self._rms(x, self.norm)
        out = (h if return_hidden else self._linear(h, self.lm_head)).float()
        return out if all_logits else out[0]

    @torch.inference_mode()
    def forward_batch(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], caches: list[KVCache],
                      all_logits: bool = False, attention: str = "auto") -> torch.Tensor:
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
            attention: ``per_seq`` (one SDPA call per sequence), ``padded`` (decode only: every length 1;
                the B attended sets zero-padded to the longest and masked, one SDPA call), or ``auto``
                (``per_seq``). On a 2-core CPU the two were equal within the run-to-run noise at batch
                1-16 (benchmarks/batch_throughput.py --attention per_seq padded), while the
                projections took ~75 % of a batch-8 step; ``padded`` needs no per-length kernel and is
                the natural one for a device where each SDPA launch costs (not measured on CUDA yet).
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
        if attention not in ("per_seq", "padded"):
            raise ValueError(f"attention mode {attention!r} unknown (choose from auto, per_seq, padded)")
        if attention == "padded" and S != len(lengths):
            raise ValueError("padded attention decodes one token per sequence; prefill uses per_seq")
        bounds, s0 = [], 0
        for n in lengths:
            bounds.append((s0, s0 + n))
            s0 += n
        x = self.embed[ids]
        cos, sin = self.rope.get(positions)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        o = torch.empty(S, H * d, device=x.device, dtype=self.dtype)
        for li, L in enumerate(self.layers):
            h = self._rms(x, L.attn_norm)
            qkv = self._linear(h, L.wqkv, L.bqkv)
            q, k, v = qkv.split(self._split, dim=-1)
            q = apply_rotary(q.view(S, H, d).transpose(0, 1), cos, sin)      # [H, S, d]
            k = apply_rotary(k.view(S, Hkv, d).transpose(0, 1), cos, sin)    # [Hkv, S, d]
            v = v.view(S, Hkv, d).transpose(0, 1)
            if attention == "padded":
                self._attend_padded(li, q, k, v, caches, o)
            else:
                for (a, b), cache in zip(bounds, caches):
                    K, V = cache.update(li, q[:, a:b], k[:, a:b], v[:, a:b])
                    T, N = b - a, K.shape[1]
                    # the T new tokens are the last T of the N attended: causal within them
                    mask = None if T == 1 else torch.ones(T, N, dtype=torch.bool, device=x.device).tril(N - T)
                    ob = F.scaled_dot_product_attention(q[None, :, a:b], K[None], V[None], attn_mask=mask,
                                                        enable_gqa=H != Hkv)
                    o[a:b] = ob[0].transpose(0, 1).reshape(T, H * d)
            x = x + self._linear(o, L.wo)
            h = self._rms(x, L.mlp_norm)
            gate, up = self._linear(h, L.w_gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, L.w_down)
        if not all_logits:
            x = x[torch.tensor([b - 1 for _, b in bounds], device=x.device)]
        return self._linear(self._rms(x, self.norm), self.lm_head).float()

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
