"""Architecture description of a decoder-only transformer of the Llama / Qwen2 family."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    Attributes:
        arch: "llama" (Llama, SmolLM2, Mistral-like) or "qwen2" (q/k/v projections carry a bias).
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

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V of one token over all layers at ``dtype_bytes`` per element."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def to_hf(self) -> dict:
        """A HF ``config.json`` dict for this architecture (used to write safetensors directories)."""
        hf_arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}[self.arch]
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
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Parse a HF ``config.json`` dict.

        Raises:
            ValueError: unsupported architecture or missing size fields.
        """
        model_type = cfg.get("model_type", "")
        arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: llama, mistral, qwen2)")
        # transformers >= 5 writes "rope_parameters" (theta inside); older configs "rope_theta" + "rope_scaling"
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
            scaling = None
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            return cls(
                arch=arch,
                n_layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                n_heads=n_heads,
                n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(cfg.get("head_dim") or hidden // n_heads),
                ffn=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                rope_theta=float(theta),
                rope_scaling=scaling,
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_ctx=int(cfg.get("max_position_embeddings", 4096)),
                attn_bias=arch == "qwen2",
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
