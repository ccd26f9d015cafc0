"""A tiny GGUF model written from the embedded model's own header: the same metadata keys in the same
order (general.*, the architecture's sizes, tokenizer settings, chat template), sizes shrunk to a
2-layer, 32-wide decoder and a 64-token vocabulary, random weights (token embedding Q8_0 as in the
embedded file, the rest F32). Small enough to write and load hundreds of mutated copies in a test.

``arch`` renames the architecture's keys: ``llama``, ``qwen2`` (q/k/v biases) or ``qwen3`` (per-head q/k
norms, and a head size of 16 given as ``qwen3.attention.key_length``, unlike hidden / heads = 8, as Qwen3
files do); :func:`llama3_rope_freqs` makes the ``rope_freqs`` tensor of a Llama 3.1+ file."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np

from zoomr.backends.gguf_file import ARRAY, GGUFArray, read_header

SIZES = {"block_count": 2, "context_length": 256, "embedding_length": 32, "feed_forward_length": 64,
         "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 64, "rope.dimension_count": 8}
N_TOKENS = 64
LAYER_SHAPES = {"attn_norm.weight": (32,), "attn_q.weight": (32, 32), "attn_k.weight": (16, 32),
                "attn_v.weight": (16, 32), "attn_output.weight": (32, 32), "ffn_norm.weight": (32,),
                "ffn_gate.weight": (64, 32), "ffn_up.weight": (64, 32), "ffn_down.weight": (32, 64)}
QWEN2_BIASES = {"attn_q.bias": (32,), "attn_k.bias": (16,), "attn_v.bias": (16,)}
# Qwen3: head size 16 (4 query heads of 16 = 64 rows, 2 KV heads = 32), written as key/value length
QWEN3_HEAD = 16
QWEN3_SIZES = {"attention.key_length": QWEN3_HEAD, "attention.value_length": QWEN3_HEAD,
               "rope.dimension_count": QWEN3_HEAD}
QWEN3_SHAPES = {"attn_q.weight": (64, 32), "attn_k.weight": (32, 32), "attn_v.weight": (32, 32),
                "attn_output.weight": (32, 64), "attn_q_norm.weight": (QWEN3_HEAD,),
                "attn_k_norm.weight": (QWEN3_HEAD,)}


@lru_cache(maxsize=4)
def header_fields(embedded: Path, arch: str = "llama") -> list[tuple[str, object, int, int | None]]:
    """(key, value, GGUF type, element type) in the embedded file's order, sizes shrunk, arrays made tiny."""
    head = read_header(embedded)
    sizes = {**SIZES, **(QWEN3_SIZES if arch == "qwen3" else {})}
    out = []
    for key, value in head.fields.items():
        vtype = head.types[key]
        if key == "general.architecture":
            continue  # the writer puts it first itself
        if key.startswith("llama."):
            key = arch + key[len("llama"):]
            value = sizes.pop(key[len(arch) + 1:], value)
        if isinstance(value, GGUFArray):
            value, sub = _tiny_array(key)
            out.append((key, value, ARRAY, sub))
            continue
        out.append((key, value, vtype, None))
    # sizes the embedded header has no key for (qwen3's key/value length), as uint32 like the others
    out.extend((f"{arch}.{suffix}", value, int(gguf.GGUFValueType.UINT32), None) for suffix, value in sizes.items())
    return out


def _tiny_array(key: str):
    if key == "tokenizer.ggml.tokens":
        return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"t{i}" for i in range(N_TOKENS - 3)], 8
    if key == "tokenizer.ggml.token_type":
        return [3, 3, 3] + [1] * (N_TOKENS - 3), 5
    if key == "tokenizer.ggml.merges":
        return ["t 1", "t 2"], 8
    return ["en"], 8


def tensors(arch: str = "llama", seed: int = 0,
            attn_std: float = 0.2) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]:
    """GGUF tensor name → (numpy data in torch order, raw ggml type or None for plain F32).

    ``attn_std``: spread of the attention projections (the other matrices have 0.2); larger values make the
    attention sharper, so that what RoPE does (``rope_freqs``, q/k norms) moves the logits more.
    """
    rng = np.random.default_rng(seed)
    embd = rng.normal(0, 0.5, size=(N_TOKENS, 32)).astype(np.float32)
    out = {"token_embd.weight": (gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)}
    shapes = {**LAYER_SHAPES, **(QWEN2_BIASES if arch == "qwen2" else QWEN3_SHAPES if arch == "qwen3" else {})}
    for i in range(SIZES["block_count"]):
        for name, shape in shapes.items():
            # q/k norms around 1, spread so that each head dimension's weight matters
            mean, std = (1.0, 0.3) if name in ("attn_q_norm.weight", "attn_k_norm.weight") else \
                (0.0, attn_std) if name.startswith(("attn_q.", "attn_k.", "attn_v.", "attn_output.")) else (0.0, 0.2)
            out[f"blk.{i}.{name}"] = (rng.normal(mean, std, size=shape).astype(np.float32), None)
    out["output_norm.weight"] = (np.ones(32, np.float32), None)
    return out


def write_tiny_gguf(path: Path, embedded: Path, arch: str = "llama", drop: tuple[str, ...] = (),
                    set_fields: dict[str, tuple] | None = None,
                    edit_tensors: dict[str, tuple | None] | None = None, attn_std: float = 0.2) -> Path:
    """Write the tiny model to ``path``.

    Args:
        drop: metadata keys to leave out (``general.architecture`` included).
        set_fields: key → (value, GGUF type[, element type]) to replace or add (added at the end).
        edit_tensors: GGUF tensor name → (data, raw type) to replace or add, or None to leave the tensor out.
        attn_std: see :func:`tensors`.
    """
    w = gguf.GGUFWriter(str(path), arch)
    if "general.architecture" in drop:
        del w.kv_data[0]["general.architecture"]
    set_fields = dict(set_fields or {})
    for key, value, vtype, sub in header_fields(embedded, arch):
        if key in drop:
            continue
        if key in set_fields:
            value, vtype, *rest = set_fields.pop(key)
            sub = rest[0] if rest else None
        w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
    for key, (value, vtype, *rest) in set_fields.items():
        sub = rest[0] if rest else None
        w.add_key_value(key, value, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
    all_tensors = tensors(arch, attn_std=attn_std)
    for name, spec in (edit_tensors or {}).items():
        if spec is None:
            all_tensors.pop(name, None)
        else:
            all_tensors[name] = spec
    for name, (data, raw) in all_tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                      original_ctx: int) -> np.ndarray:
    """The [head_dim // 2] float32 ``rope_freqs.weight`` that llama.cpp's ``convert_hf_to_gguf.py`` (LlamaModel,
    ``rope_type`` "llama3") writes for a Llama 3.1+ checkpoint: per frequency 1 where the wavelength is below
    ``original_ctx / high_freq_factor`` (tokens), ``factor`` above ``original_ctx / low_freq_factor``, and
    ``1 / ((1 - s) / factor + s)`` between, s = (original_ctx / wavelength - low) / (high - low). Written here
    from that description, independently of zoomr's own llama3 RoPE (backends/torch/rope.py)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < original_ctx / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_ctx / low_freq_factor:
            out.append(factor)
        else:
            s = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


def hf_dir_from_gguf(gguf_path: Path, out: Path) -> Path:
    """``out`` written as the HF directory of the GGUF model ``gguf_path`` (zoomr's reader, then writer)."""
    from zoomr.backends.torch.weights import load_gguf, write_hf_dir

    cfg, weights, _ = load_gguf(gguf_path)
    write_hf_dir(cfg, weights, out)
    return out
