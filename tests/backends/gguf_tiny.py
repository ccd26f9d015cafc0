"""A tiny GGUF model written from the embedded model's own header: the same metadata keys in the same
order (general.*, the architecture's sizes, tokenizer settings, chat template), sizes shrunk to a
2-layer, 32-wide decoder and a 64-token vocabulary, random weights (token embedding Q8_0 as in the
embedded file, the rest F32). Small enough to write and load hundreds of mutated copies in a test."""

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


@lru_cache(maxsize=4)
def header_fields(embedded: Path, arch: str = "llama") -> list[tuple[str, object, int, int | None]]:
    """(key, value, GGUF type, element type) in the embedded file's order, sizes shrunk, arrays made tiny."""
    head = read_header(embedded)
    out = []
    for key, value in head.fields.items():
        vtype = head.types[key]
        if key == "general.architecture":
            continue  # the writer puts it first itself
        if key.startswith("llama."):
            key = arch + key[len("llama"):]
            suffix = key[len(arch) + 1:]
            value = SIZES.get(suffix, value)
        if isinstance(value, GGUFArray):
            value, sub = _tiny_array(key)
            out.append((key, value, ARRAY, sub))
            continue
        out.append((key, value, vtype, None))
    return out


def _tiny_array(key: str):
    if key == "tokenizer.ggml.tokens":
        return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"t{i}" for i in range(N_TOKENS - 3)], 8
    if key == "tokenizer.ggml.token_type":
        return [3, 3, 3] + [1] * (N_TOKENS - 3), 5
    if key == "tokenizer.ggml.merges":
        return ["t 1", "t 2"], 8
    return ["en"], 8


def tensors(arch: str = "llama", seed: int = 0) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]:
    """GGUF tensor name → (numpy data in torch order, raw ggml type or None for plain F32)."""
    rng = np.random.default_rng(seed)
    embd = rng.normal(0, 0.5, size=(N_TOKENS, 32)).astype(np.float32)
    out = {"token_embd.weight": (gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)}
    shapes = {**LAYER_SHAPES, **(QWEN2_BIASES if arch == "qwen2" else {})}
    for i in range(SIZES["block_count"]):
        for name, shape in shapes.items():
            out[f"blk.{i}.{name}"] = (rng.normal(0, 0.2, size=shape).astype(np.float32), None)
    out["output_norm.weight"] = (np.ones(32, np.float32), None)
    return out


def write_tiny_gguf(path: Path, embedded: Path, arch: str = "llama", drop: tuple[str, ...] = (),
                    set_fields: dict[str, tuple] | None = None,
                    edit_tensors: dict[str, tuple | None] | None = None) -> Path:
    """Write the tiny model to ``path``.

    Args:
        drop: metadata keys to leave out (``general.architecture`` included).
        set_fields: key → (value, GGUF type[, element type]) to replace or add (added at the end).
        edit_tensors: GGUF tensor name → (data, raw type) to replace or add, or None to leave the tensor out.
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
    all_tensors = tensors(arch)
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
