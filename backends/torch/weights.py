"""Weight loading for the torch backend: GGUF files (``gguf`` package) and HF safetensors directories.

Both paths produce the same thing: a :class:`ModelConfig` and a dict of float32 numpy arrays under
HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` ...), with Q/K rows in HF order so
one RoPE implementation (rotate-half) serves both.

Source of the GGUF layout: llama.cpp's ``convert_hf_to_gguf.py`` (tensor names, the Q/K row
permutation it applies to the ``llama`` architecture, ``rope_freqs`` factors).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import SUPPORTED_ARCHS, ModelConfig


class ModelLoadError(ValueError):
    """A model file or directory is missing, corrupt, truncated or of an unsupported architecture."""


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → HF rotate-half order).

    Args:
        w: [n_heads*head_dim, in] weight or [n_heads*head_dim] bias as stored in a ``llama`` GGUF.
    Returns:
        The same tensor with rows reordered so that, per head, dims [0, d/2) and [d/2, d) pair up.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf_config(reader) -> ModelConfig:
    """Model configuration from a ``gguf.GGUFReader``'s metadata.

    Raises:
        ModelLoadError: unsupported ``general.architecture`` or missing size fields.
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    return ModelConfig(
        arch=arch,
        n_layers=int(need("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        ffn=int(need("feed_forward_length")),
        vocab=vocab,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in names,
        max_ctx=int(_field(reader, f"{arch}.context_length", 4096)),
        attn_bias="blk.0.attn_q.bias" in names,
    )


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Read and dequantize a GGUF file.

    Args:
        path: GGUF file.
    Returns:
        (config, tensors as float32 arrays under HF names, metadata dict with ``chat_template``).
    Raises:
        ModelLoadError: not a GGUF file, truncated, unsupported architecture or quantization.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError... on corrupt files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    cfg = read_gguf_config(reader)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue
            name = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
        elif t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:  # gguf's signal for a quantization type it cannot dequantize
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from None
        # F32 tensors come back as read-only views of the memory-mapped file: copy those
        arr = np.require(arr, np.float32, ["C", "W"]).reshape([int(x) for x in reversed(t.shape)])
        if cfg.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.n_heads if ".q_proj." in name else cfg.n_kv_heads
            arr = unpermute_qk(arr, heads)
        tensors[name] = arr
    _check_complete(cfg, tensors, str(path))
    meta = {"chat_template": _field(reader, "tokenizer.chat_template")}
    return cfg, tensors, meta


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Read a HF causal-LM directory (``config.json`` + ``*.safetensors``) and check every tensor is there.

    Returns:
        (config, float32 tensors under HF names, metadata dict).
    Raises:
        ModelLoadError: no config.json, no or corrupt safetensors, unsupported architecture, missing tensors.
    """
    cfg, tensors = read_hf_dir(path)
    _check_complete(cfg, tensors, str(path))
    return cfg, tensors, {}


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float32 tensors of a HF directory, without checking which tensors exist (heads vary).

    Raises:
        ModelLoadError: no config.json, no or corrupt safetensors, unsupported architecture.
    """
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json in this directory")
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: {e}") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            tensors.update(_load_safetensors_f32(f))
        except Exception as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
    return cfg, tensors


def _load_safetensors_f32(f: Path) -> dict[str, np.ndarray]:
    """safetensors → float32 numpy, going through torch so bf16 checkpoints load too."""
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(str(f)).items()}


def _check_complete(cfg: ModelConfig, tensors: dict, where: str) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.n_layers):
        needed += [f"model.layers.{i}.{n}" for n in _GGUF_LAYER_NAMES.values() if "bias" not in n]
    if not cfg.tied_embeddings:
        needed.append("lm_head.weight")
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ModelLoadError(f"{where}: weights incomplete, {len(missing)} tensors missing (first: {missing[0]})")


def write_hf_dir(cfg: ModelConfig, tensors: dict[str, np.ndarray], out: Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (float32) that :func:`load_hf_dir` reads back."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items() if k != "rope_freqs"},
              str(out / "model.safetensors"))
