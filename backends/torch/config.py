"""Architecture description of a decoder-only transformer of the Llama / Qwen2 / Qwen3 family."""

from __future__ import annotations

from dataclasses import dataclass, field

from zoomr.backends.models import model_warning, short_repr

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
# RoPE scalings the decoder implements (backends/torch/rope.py); None = plain RoPE
ROPE_SCALINGS = (None, "default", "linear", "llama3")
# the parameters each scaling cannot do without (transformers' rope init functions read them with no default)
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# transformers' documented defaults (LlamaConfig, Qwen2Config) for keys a config.json may omit; the
# qwen2/qwen3 RoPE base is left out on purpose: transformers' 10000 is not what any Qwen2 or Qwen3 was trained with
HF_RMS_EPS_DEFAULT = 1e-6
HF_ROPE_THETA_DEFAULTS = {"llama": 10000.0}
QWEN3_HEAD_DIM_DEFAULT = 128
# config.json model_type -> decoder architecture (Mistral is Llama's layout)
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# HF class and model_type each architecture is written back as (to_hf)
_HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3")}


@dataclass
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    Attributes:
        arch: "llama" (Llama 1-3.x, SmolLM2, Mistral-like), "qwen2" (q/k/v projections carry a bias) or
            "qwen3" (no biases; RMSNorm over each query and key head before RoPE, :attr:`qk_norm`).
        n_layers, hidden, n_heads, n_kv_heads, head_dim, ffn, vocab: sizes (GQA when n_kv_heads < n_heads).
        rope_theta: RoPE base.
        rope_scaling: HF-style dict ({"rope_type": "linear"|"llama3", "factor": ..., ...}) or None.
        rms_eps: RMSNorm epsilon.
        tied_embeddings: the LM head reuses the token embedding matrix.
        max_ctx: trained context length (tokens).
        attn_bias: q/k/v projections have a bias (Qwen2).
    """

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_eps: float = 1e-6
    tied_embeddings: bool = False
    max_ctx: int = 4096
    attn_bias: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def qk_norm(self) -> bool:
        """Queries and keys pass a per-head RMSNorm (weights [head_dim], shared by the heads) between the
        projection and RoPE: Qwen3 (transformers ``Qwen3Attention``; llama.cpp ``attn_q_norm``/``attn_k_norm``)."""
        return self.arch == "qwen3"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V of one token over all layers at ``dtype_bytes`` per element."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def to_hf(self) -> dict:
        """A HF ``config.json`` dict for this architecture (used to write safetensors directories)."""
        hf_arch = _HF_CLASSES[self.arch]
        cfg = {
            "architectures": [hf_arch[0]],
            "model_type": hf_arch[1],
            "num_hidden_layers": self.n_layers,
            "hidden_size": self.hidden,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn,
            "vocab_size": self.vocab,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tied_embeddings,
            "max_position_embeddings": self.max_ctx,
        }
        if self.arch == "qwen3":
            # transformers' Qwen3 has q/k/v biases only together with an o_proj one, which zoomr's decoder (and a
            # GGUF qwen3) lacks: written as it is, such a model is refused by name where it is read back
            cfg["attention_bias"] = self.attn_bias
        return cfg

    def validate(self) -> None:
        """Check the sizes fit together (before any tensor is read).

        Raises:
            ValueError: heads that do not split into KV groups, an odd or empty head size, a RoPE scaling
                the decoder does not implement or without one of its parameters (:data:`ROPE_SCALING_KEYS`).
        """
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads do not split into groups of {self.n_kv_heads} KV heads")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} is not a positive even number (RoPE rotates pairs)")
        kind = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type")
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling {short_repr(kind)} is not implemented by the torch backend "
                             f"(supported: {', '.join(k for k in ROPE_SCALINGS if k)})")
        for key in ROPE_SCALING_KEYS.get(kind, ()):
            v = self.rope_scaling.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                # transformers reads these without defaults: a guess would change every long-range logit
                raise ValueError(f"RoPE scaling {kind!r} needs {key} (a number > 0), got {short_repr(v)}")

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Every tensor the decoder may read, by HF name: (shape [out, in] as in torch, required).

        Optional ones: q/k/v biases of a model without them, the LM head of a tied model, and GGUF
        ``rope_freqs`` (per-frequency RoPE divisors, [head_dim // 2]). Qwen3 requires the per-head query and
        key norms, ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``, each [head_dim].
        """
        H, d = self.hidden, self.head_dim
        q, kv = self.n_heads * d, self.n_kv_heads * d
        shapes = {"model.embed_tokens.weight": ((self.vocab, H), True),
                  "model.norm.weight": ((H,), True),
                  "lm_head.weight": ((self.vocab, H), not self.tied_embeddings),
                  "rope_freqs": ((d // 2,), False)}
        layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
                 "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
                 "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
                 "mlp.gate_proj.weight": (self.ffn, H), "mlp.up_proj.weight": (self.ffn, H),
                 "mlp.down_proj.weight": (H, self.ffn)}
        if self.qk_norm:
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        bias = {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        for i in range(self.n_layers):
            shapes.update({f"model.layers.{i}.{n}": (s, True) for n, s in layer.items()})
            shapes.update({f"model.layers.{i}.{n}": (s, self.attn_bias) for n, s in bias.items()})
        return shapes

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "ModelConfig":
        """Parse a HF ``config.json`` dict; ``where`` names the file in messages.

        Sizes are required. A missing ``rms_norm_eps`` (and a llama ``rope_theta``) takes transformers'
        documented default with one warning line; a qwen2 or qwen3 config without ``rope_theta`` is refused (see
        ``zoomr.backends.gguf_file.ROPE_BASE_DEFAULTS``). Defaults that tensor shapes confirm
        (``num_key_value_heads`` = heads, ``head_dim`` = hidden / heads, for qwen3 transformers' 128) are taken
        silently; Qwen3 configs give ``head_dim``, and it may differ from hidden / heads.

        Raises:
            ValueError: not a JSON object, unsupported architecture or activation, a missing or ill-typed
                size, sizes that do not fit together, what the decoder does not implement: sliding-window
                attention (Qwen2/Qwen3 ``use_sliding_window``), an output-projection bias (transformers' Llama
                and Qwen3 put one on ``o_proj`` when ``attention_bias`` is set).
        """
        if not isinstance(cfg, dict):
            raise ValueError(f"{where} is not a JSON object")
        model_type = cfg.get("model_type", "")
        arch = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise ValueError(f"{where}: unsupported model_type {short_repr(model_type)} "
                             f"(supported: {', '.join(HF_MODEL_TYPES)}; other architectures run from a GGUF file "
                             "with --backend llamacpp)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {short_repr(cfg['hidden_act'])} is not implemented "
                             "(the decoder's MLP is SwiGLU, silu)")
        if cfg.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias is not implemented (the decoder's MLP has no biases)")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window is set: sliding-window attention is not implemented "
                             "by the torch backend (--backend llamacpp runs it from a GGUF file)")
        if arch in ("llama", "qwen3") and cfg.get("attention_bias"):
            # with attention_bias transformers adds an o_proj bias to these two, which the decoder has no place for
            raise ValueError(f"{where}: attention_bias is set: the {model_type} output projection's bias is not "
                             "implemented by the torch backend")

        def size(key: str, default=None) -> int:
            v = cfg.get(key)
            if v is None:
                if default is None:
                    raise ValueError(f"{where} lacks {key}")
                return default
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {key} is {short_repr(v)}, expected an integer >= 1")
            return v

        def number(v, key: str) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{where}: {key} is {short_repr(v)}, expected a finite number >= 0")
            return float(v)

        # transformers >= 5 writes "rope_parameters" (theta inside); older configs "rope_theta" + "rope_scaling"
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{where}: rope_scaling is {short_repr(rope)}, expected an object")
        other = cfg.get("rope_scaling") if rope is cfg.get("rope_parameters") else None
        if isinstance(other, dict):
            def kind_of(r: dict) -> str:
                return r.get("rope_type") or r.get("type") or "default"

            if kind_of(other) != kind_of(rope):  # either reading would run the other's RoPE without a word
                raise ValueError(f"{where}: rope_parameters ({kind_of(rope)!r}) and rope_scaling "
                                 f"({kind_of(other)!r}) disagree; keep one of them")
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            if arch not in HF_ROPE_THETA_DEFAULTS:
                raise ValueError(f"{where} lacks rope_theta")
            theta = HF_ROPE_THETA_DEFAULTS[arch]
            model_warning(f"{where} lacks rope_theta; assuming {theta:g}, transformers' default for {arch} "
                          "(wrong for models trained with another base)")
        if number(theta, "rope_theta") == 0:
            raise ValueError(f"{where}: rope_theta is 0, expected a RoPE base > 0")
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
            scaling = None
        eps = cfg.get("rms_norm_eps")
        if eps is None:
            eps = HF_RMS_EPS_DEFAULT
            model_warning(f"{where} lacks rms_norm_eps; assuming {eps:g}, transformers' default")
        hidden = size("hidden_size")
        n_heads = size("num_attention_heads")
        c = cls(
            arch=arch,
            n_layers=size("num_hidden_layers"),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=size("num_key_value_heads", n_heads),
            # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads (shapes confirm either)
            head_dim=size("head_dim", QWEN3_HEAD_DIM_DEFAULT if arch == "qwen3" else hidden // n_heads or None),
            ffn=size("intermediate_size"),
            vocab=size("vocab_size"),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_eps=number(eps, "rms_norm_eps"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # sizes only the first RoPE table (it grows on demand): no effect on logits, so no warning
            max_ctx=size("max_position_embeddings", 4096),
            attn_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        )
        try:
            c.validate()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return c
