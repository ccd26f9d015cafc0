"""Weight loading for the torch backend: GGUF files (``gguf`` package) and HF safetensors directories.

Both paths produce the same thing: a :class:`ModelConfig` and a dict of float32 numpy arrays under
HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` ...), with Q/K rows in HF order so
one RoPE implementation (rotate-half) serves both.

Nothing is trusted before it is checked: the GGUF header against the file's size
(:mod:`zoomr.backends.gguf_file`), the configuration's sizes against each other, and every tensor's
presence, shape and type against the configuration, all before the first weight is read.

Source of the GGUF layout: llama.cpp's ``convert_hf_to_gguf.py`` (tensor names, the Q/K row
permutation it applies to the ``llama`` architecture only, not to ``qwen2``/``qwen3``, whose RoPE is
rotate-half already; Llama 3.1+'s ``rope_freqs`` factors) and ``llama-model.cpp`` (which tensors each
architecture reads).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from zoomr.backends.gguf_file import (PER_LAYER_KEYS, ROPE_BASE_DEFAULTS, GGUFArray, GGUFHeader, check_gguf,
                                      gguf_float, gguf_int, shown_name)
from zoomr.backends.models import ModelLoadError, short_repr

from .config import SUPPORTED_ARCHS, ModelConfig
from .ggml_layers import RawWeight
from .quant import GGUF_BLOCK_TYPES, GroupQuant, from_gguf_blocks


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
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
}
_GGUF_QKV_BIAS_NAMES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# What each architecture has beyond the common tensors, as llama.cpp's loader reads them (it refuses a file with
# any other): (per-layer names, global names). The q/k/v biases are optional for llama and qwen3, required for
# qwen2 (config.py tensor_shapes); rope_freqs is where llama.cpp's converter puts Llama 3.1+'s "llama3" RoPE
# scaling. llama.cpp reads rope_freqs for llama alone, and an output-projection bias, which the decoder does not
# implement, for llama alone: such a file is refused here by the bias's name.
_GGUF_ARCH_NAMES = {
    "llama": (_GGUF_QKV_BIAS_NAMES, {"rope_freqs.weight": "rope_freqs"}),
    "qwen2": (_GGUF_QKV_BIAS_NAMES, {}),
    "qwen3": ({**_GGUF_QKV_BIAS_NAMES, "attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight"}, {}),
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


def read_gguf_config(head: GGUFHeader) -> ModelConfig:
    """Model configuration from a checked GGUF header (:func:`zoomr.backends.gguf_file.check_gguf`).

    Defaults are llama.cpp's (``llama-model.cpp``, ``load_hparams``): KV heads = heads, head size =
    embedding / heads, RoPE scaling type "linear" with factor 1, vocabulary = the token list's length.

    Raises:
        ModelLoadError: unsupported architecture, or metadata the torch decoder cannot run: per-layer sizes
            that differ, a V head size or RoPE dimension other than the K head size, YaRN/LongRoPE scaling,
            experts, more tokens than vocabulary, sizes that do not fit together.
    """
    arch = head.arch
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{head.path}: unsupported GGUF architecture {short_repr(arch)} for the torch backend "
                             f"(supported: {', '.join(SUPPORTED_ARCHS)}; --backend llamacpp runs more)")

    def fail(what: str) -> ModelLoadError:
        return ModelLoadError(f"{head.path}: {what}")

    def one(key: str, default=None) -> int:
        v = gguf_int(head, f"{arch}.{key}", default, per_layer=key in PER_LAYER_KEYS)
        if isinstance(v, tuple):  # a per-layer array: the decoder has one size for all layers
            if len(set(v)) != 1:
                raise fail(f"GGUF metadata {arch}.{key} differs between layers ({min(v)}..{max(v)}), which the torch "
                           "backend does not implement (--backend llamacpp runs it)")
            v = v[0]
        return v

    n_layers = one("block_count")
    hidden = one("embedding_length")
    n_heads = one("attention.head_count")
    head_dim = one("attention.key_length", hidden // n_heads or None)
    if head_dim is None:
        raise fail(f"GGUF metadata {arch}.embedding_length {hidden} is smaller than the {n_heads} heads")
    for key in ("attention.value_length", "rope.dimension_count"):
        if one(key, head_dim) != head_dim:
            raise fail(f"GGUF metadata {arch}.{key} is {one(key)}, not the head size {head_dim}, which the torch "
                       "backend does not implement (--backend llamacpp runs it)")
    experts = head.get(f"{arch}.expert_count", 0)
    if experts:
        raise fail(f"GGUF metadata {arch}.expert_count is {short_repr(experts)}: mixture-of-experts models are not "
                   "implemented by the torch backend (--backend llamacpp runs them)")
    tokens = head.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if isinstance(tokens, GGUFArray) else None
    vocab = one("vocab_size", n_tokens)
    if vocab is None:
        raise fail(f"GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
    if n_tokens is not None and n_tokens > vocab:
        raise fail(f"GGUF metadata lists {n_tokens} tokens for a vocabulary of {vocab} ({arch}.vocab_size)")
    names = {t.name for t in head.tensors}
    cfg = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=one("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn=one("feed_forward_length"),
        vocab=vocab,
        rope_theta=gguf_float(head, f"{arch}.rope.freq_base", ROPE_BASE_DEFAULTS.get(arch)),
        rope_scaling=_gguf_rope_scaling(head, arch),
        rms_eps=gguf_float(head, f"{arch}.attention.layer_norm_rms_epsilon"),
        tied_embeddings="output.weight" not in names,
        max_ctx=one("context_length"),
        attn_bias="blk.0.attn_q.bias" in names,
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise fail(f"GGUF metadata: {e}") from None
    return cfg


def _gguf_rope_scaling(head: GGUFHeader, arch: str) -> dict | None:
    """llama.cpp's reading: type "linear" unless named, factor from ``rope.scaling.factor`` (or the older
    ``rope.scale_linear``), where 0 or absent means 1 (no scaling).

    Llama 3.1+'s "llama3" scaling names no type here: llama.cpp's converter stores it as the ``rope_freqs``
    tensor (per-frequency divisors, applied by the decoder, :func:`zoomr.backends.torch.rope.inv_frequencies`).

    Raises:
        ModelLoadError: a named type other than none/linear (yarn, longrope: not implemented here).
    """
    kind = head.get(f"{arch}.rope.scaling.type", "linear")
    factor = gguf_float(head, f"{arch}.rope.scaling.factor") or gguf_float(head, f"{arch}.rope.scale_linear") or 1.0
    if kind == "none" or factor == 1.0:
        return None
    if kind != "linear":
        raise ModelLoadError(f"{head.path}: GGUF metadata {arch}.rope.scaling.type is {kind!r}, which the torch "
                             "backend does not implement (--backend llamacpp runs it)")
    return {"rope_type": "linear", "factor": factor}


def _gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name → HF name, for every tensor the decoder may read from a file of ``cfg.arch``."""
    extra_layer, extra_global = _GGUF_ARCH_NAMES[cfg.arch]
    layer = {**_GGUF_LAYER_NAMES, **extra_layer}
    names = {**_GGUF_GLOBAL_NAMES, **extra_global}
    for i in range(cfg.n_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{hf}" for g, hf in layer.items()})
    return names


def load_gguf(path: Path, keep_blocks: bool = False, raw: bool = False,
              layers: int | None = None) -> tuple[ModelConfig, dict[str, np.ndarray | GroupQuant | RawWeight], dict]:
    """Read a GGUF file, after checking its header, metadata and every tensor's shape.

    Memory: at most 4 bytes per element of the tensors the checked header describes (float32 copies; 2
    bytes of codes plus scales for kept blocks), each of which lies inside the file; nothing is allocated
    before every check has passed.

    Args:
        path: GGUF file.
        keep_blocks: return 2-D tensors of the block types the int kernels hold (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
            Q4_K, Q5_K, Q6_K: :data:`zoomr.backends.torch.quant.GGUF_BLOCK_TYPES`) as their exact codes and
            scales (:func:`zoomr.backends.torch.quant.from_gguf_blocks`) instead of dequantizing them; other
            types (F16, Q2_K, Q3_K …) are dequantized.
        raw: return every 2-D tensor as the file's bytes (:class:`zoomr.backends.torch.ggml_layers.RawWeight`,
            for ``--quant ggml``); only the 1-D ones (norms, biases) are read as float32.
        layers: read only the first ``layers`` layers' tensors (and the global ones); the returned config
            says ``n_layers = layers`` (a probe's cut-down model). None: all.
    Returns:
        (config, tensors under HF names: float32 arrays, or :class:`GroupQuant` where blocks are kept,
        metadata dict with ``chat_template``).
    Raises:
        ModelLoadError: not a GGUF file, a corrupt or truncated header or data, missing or ill-typed
            metadata, unsupported architecture or quantization, missing, unknown or misshapen tensors.
    """
    import gguf

    head = check_gguf(path)
    cfg = read_gguf_config(head)
    to_hf = _gguf_names(cfg)
    named = {}
    for t in head.tensors:
        if t.name not in to_hf:  # llama.cpp refuses a file with tensors its architecture does not have, too
            raise ModelLoadError(f"{path}: tensor {shown_name(t.name)} is not part of a {cfg.arch} model")
        named[to_hf[t.name]] = t
    check_shapes(cfg, {n: t.shape for n, t in named.items()}, str(path), file_names={hf: g for g, hf in to_hf.items()})
    for qtype in {t.ggml_type for t in named.values()}:
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:  # one zero block: gguf's signal for a type it cannot dequantize, before any real allocation
            gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
        except NotImplementedError:  # gguf's own answer for such a type (e.g. IQ-quants): refused by name here
            first = next(t.name for t in named.values() if t.ggml_type == qtype)
            raise ModelLoadError(f"{path}: tensor {first} has unsupported type {qtype.name}") from None
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray | GroupQuant] = {}
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layers=min(layers, cfg.n_layers))
        named = {n: t for n, t in named.items()
                 if not n.startswith("model.layers.") or int(n.split(".")[2]) < cfg.n_layers}
    for name, t in named.items():
        block, type_size = gguf.GGML_QUANT_SIZES[t.ggml_type]
        rows = t.shape[:-1]
        raw_bytes = data[t.offset:t.offset + t.n_bytes].reshape(*rows, t.ne[0] // block * type_size)
        # a llama file's Q/K rows are in llama.cpp's interleaved RoPE order: every form is put back in HF order
        heads = (cfg.n_heads if ".q_proj." in name else cfg.n_kv_heads) if cfg.arch == "llama" and (
            ".q_proj." in name or ".k_proj." in name) else None
        if (raw and len(rows) == 1) or (keep_blocks and len(rows) == 1 and t.ggml_type.name in GGUF_BLOCK_TYPES):
            w = (RawWeight(raw_bytes, int(t.ggml_type), t.ggml_type.name, tuple(t.shape)) if raw
                 else from_gguf_blocks(raw_bytes, t.ggml_type.name))
            tensors[name] = w if heads is None else w.take_rows(unpermute_qk(np.arange(w.shape[0]), heads))
            continue
        arr = gguf.quants.dequantize(raw_bytes, t.ggml_type)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those
        arr = np.require(arr, np.float32, ["C", "W"]).reshape(t.shape)
        tensors[name] = arr if heads is None else unpermute_qk(arr, heads)
    del data
    meta = {"chat_template": head.get("tokenizer.chat_template")}
    return cfg, tensors, meta


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str, lm_head: bool = True,
                 file_names: dict[str, str] | None = None) -> None:
    """Every tensor the configuration requires is present and every present one has its shape.

    Args:
        shapes: HF tensor name → shape (torch order); names the decoder does not read are ignored.
        where: the file or directory, for messages.
        lm_head: require ``lm_head.weight`` of an untied model (a PRM body has none).
        file_names: HF name → the name the file uses (GGUF), for messages; HF names otherwise.
    Raises:
        ModelLoadError: the first missing tensor (with the count) or the first misshapen one.
    """
    expected = cfg.tensor_shapes()
    named = (file_names or {}).get
    missing = [n for n, (_, required) in expected.items()
               if required and n not in shapes and (lm_head or n != "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{where}: weights incomplete, {len(missing)} tensors missing "
                             f"(first: {named(missing[0], missing[0])})")
    for name, shape in shapes.items():
        if name in expected and tuple(shape) != expected[name][0]:
            # GGUF records dimensions fastest-first: show them as the file has them
            got, need = (list(reversed(shape)), list(reversed(expected[name][0]))) if file_names else \
                (list(shape), list(expected[name][0]))
            raise ModelLoadError(f"{where}: tensor {named(name, name)} has shape {got}, the configuration "
                                 f"needs {need}")


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], dict]:
    """Read a HF causal-LM directory (``config.json`` + ``*.safetensors``), every tensor checked first.

    Returns:
        (config, float32 tensors under HF names, metadata dict).
    Raises:
        ModelLoadError: see :func:`read_hf_dir`; also a missing LM head of an untied model.
    """
    cfg, tensors = read_hf_dir(path, lm_head=True)
    return cfg, tensors, {}


# safetensors dtypes the decoder converts to float32; weights of any other type are refused
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def read_hf_dir(path: Path, lm_head: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Config and float32 tensors of a HF directory. Weights are safetensors only (no pickle) and are
    checked from the files' headers before any is read: every tensor the configuration requires is
    present (the LM head only when ``lm_head``: heads vary, a PRM has none), shapes match the
    configuration, dtypes are floating point. Tensors the decoder does not read are kept when
    floating point (a PRM's ``score.*`` head) and skipped otherwise.

    Raises:
        ModelLoadError: no or invalid config.json, no or corrupt safetensors, unsupported architecture,
            a tensor in two files, missing, misshapen or non-float tensors.
    """
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json in this directory")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    try:
        cfg = ModelConfig.from_hf(raw, str(cfg_path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    index = _safetensors_index(path)
    if cfg.n_layers > len(index):  # each layer has tensors of its own: checked before the count is looped over
        raise ModelLoadError(f"{cfg_path}: num_hidden_layers is {cfg.n_layers}, but the weights hold "
                             f"{len(index)} tensors")
    check_shapes(cfg, {n: shape for n, (_, shape, _) in index.items()}, str(path), lm_head=lm_head)
    expected = cfg.tensor_shapes()
    for name, (f, _, dtype) in index.items():
        if name in expected and dtype not in _FLOAT_DTYPES:
            raise ModelLoadError(f"{f}: tensor {name} has dtype {dtype} (expected one of {', '.join(_FLOAT_DTYPES)})")
    wanted = {n: f for n, (f, _, dtype) in index.items() if dtype in _FLOAT_DTYPES}
    return cfg, _load_safetensors_f32(wanted)


def _safetensors_index(path: Path) -> dict[str, tuple[Path, list[int], str]]:
    """Tensor name → (file, shape, dtype) from the headers of every ``*.safetensors`` in ``path``
    (safetensors checks its header against the file's size; no tensor data is read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    index: dict[str, tuple[Path, list[int], str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                entries = [(k, sf.get_slice(k)) for k in sf.keys()]
                entries = [(k, sl.get_shape(), sl.get_dtype()) for k, sl in entries]
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on a bad file
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        for k, shape, dtype in entries:
            if k in index:
                raise ModelLoadError(f"{f}: tensor {shown_name(k)} is also in {index[k][0].name}")
            index[k] = (f, list(shape), dtype)
    return index


def _load_safetensors_f32(wanted: dict[str, Path]) -> dict[str, np.ndarray]:
    """The named tensors as float32 numpy, going through torch so bf16 checkpoints load too."""
    from safetensors import safe_open

    tensors: dict[str, np.ndarray] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in wanted.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in names:
                    tensors[name] = sf.get_tensor(name).float().numpy()
        except Exception as e:
            raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
    return tensors


def _check_complete(cfg: ModelConfig, tensors: dict, where: str) -> None:
    """:func:`check_shapes` over loaded tensors (a PRM checks its body this way once its head is split off)."""
    check_shapes(cfg, {n: a.shape for n, a in tensors.items()}, where)


def rope_freqs_trivial(tensors: dict) -> bool:
    """True when ``tensors`` hold no GGUF ``rope_freqs`` divisors, or only ones (plain RoPE)."""
    freqs = tensors.get("rope_freqs")
    return freqs is None or bool(np.all(np.asarray(freqs) == 1.0))


def write_hf_dir(cfg: ModelConfig, tensors: dict[str, np.ndarray], out: Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (float32) that :func:`load_hf_dir` reads back.

    Raises:
        ValueError: ``rope_freqs`` divisors other than 1 (a Llama 3.1+ GGUF): a HF config names its RoPE
            scaling by parameters, not divisors, so the directory would run with plain RoPE.
    """
    from safetensors.numpy import save_file

    if not rope_freqs_trivial(tensors):
        raise ValueError("rope_freqs divisors (Llama 3.1+ RoPE scaling from a GGUF) cannot be written to a HF "
                         "directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items() if k != "rope_freqs"},
              str(out / "model.safetensors"))
