"""Model files are validated, not trusted: GGUF headers and metadata, safetensors directories and their
config.json, chat templates. Every bad file ends in one ModelLoadError (a ValueError) line naming the file
and the field, before any weight is allocated; documented defaults are taken with one warning line.

The GGUFs are the tiny model of ``gguf_tiny`` (the embedded model's header, sizes shrunk), written whole
with the ``gguf`` package or byte-mutated; the CLI tests mutate a copy of the embedded model itself.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from gguf import GGUFValueType as V

from zoomr.backends.chat_template import MAX_TEMPLATE_BYTES, ChatTemplateError, _env, render_chat
from zoomr.backends.gguf_file import REQUIRED_KEYS, read_header
from zoomr.backends.models import HF_FILE_PATTERNS, ModelLoadError
from zoomr.backends.torch.weights import load_gguf, load_hf_dir

from conftest import ENV, ROOT, assert_one_line_error, zoomr
from gguf_tiny import hf_dir_from_gguf, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, embedded_path) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", embedded_path)


def bad(tmp_path, embedded_path, **edits) -> Path:
    return write_tiny_gguf(tmp_path / "bad.gguf", embedded_path, **edits)


def refused(path: Path, pattern: str, loader=load_gguf) -> str:
    """The loader refuses ``path`` with one line that names the file and matches ``pattern``."""
    with pytest.raises(ModelLoadError) as e:
        loader(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert re.search(pattern, msg), msg
    return msg


def patched(src: Path, dst: Path, at: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes())
    raw[at:at + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def value_at(raw: bytes, key: str) -> int:
    """Byte offset of the value of metadata ``key`` (after its key string and u32 type)."""
    return raw.index(key.encode()) + len(key) + 4


# --- the tiny model itself ---------------------------------------------------------------------------

def test_tiny_model_keeps_the_embedded_header_and_loads(tiny, embedded_path):
    """The fixture is faithful: same keys in the same order as the embedded file, and it loads and runs."""
    import torch

    from zoomr.backends.torch.model import Decoder
    from zoomr.kvstore.base import FullKVCache

    assert list(read_header(tiny).fields) == list(read_header(embedded_path).fields)
    cfg, tensors, meta = load_gguf(tiny)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.vocab) == (2, 32, 4, 2, 64)
    assert cfg.rope_theta == 100000.0 and meta["chat_template"].startswith("{% for message in messages %}")
    dec = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    logits = dec.forward(torch.tensor([1, 5, 9]), torch.arange(3), cache, all_logits=True)
    assert logits.shape == (3, 64) and torch.isfinite(logits).all()


# --- metadata ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_required_key_is_named(tmp_path, embedded_path, key):
    refused(bad(tmp_path, embedded_path, drop=(f"llama.{key}",)), rf"GGUF metadata lacks llama\.{re.escape(key)}$")


def test_missing_architecture(tmp_path, embedded_path):
    refused(bad(tmp_path, embedded_path, drop=("general.architecture",)), "GGUF metadata lacks general.architecture$")


def test_llama_without_rope_base_takes_llamacpps_default_with_one_warning(tmp_path, embedded_path, capsys):
    cfg, _, _ = load_gguf(bad(tmp_path, embedded_path, drop=("llama.rope.freq_base",)))
    assert cfg.rope_theta == 10000.0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoomr: warning: ") and "llama.rope.freq_base" in err[0], err


def test_qwen2_without_rope_base_is_refused(tmp_path, embedded_path):
    refused(write_tiny_gguf(tmp_path / "q.gguf", embedded_path, arch="qwen2", drop=("qwen2.rope.freq_base",)),
            r"GGUF metadata lacks qwen2\.rope\.freq_base$")


@pytest.mark.parametrize("key, value, pattern", [
    ("llama.block_count", ("two", V.STRING), r"llama\.block_count is 'two', expected an integer from 1 to 512"),
    ("llama.feed_forward_length", ("64", V.STRING), r"llama\.feed_forward_length is a string, expected an integer"),
    ("llama.attention.head_count", (0, V.UINT32), r"head_count is 0, expected >= 1"),
    ("llama.rope.freq_base", (float("nan"), V.FLOAT32), r"freq_base is nan"),
    ("llama.rope.freq_base", (0.0, V.FLOAT32), r"freq_base is 0"),
    ("llama.attention.layer_norm_rms_epsilon", (-1.0, V.FLOAT32), r"epsilon is -1.0"),
    ("llama.block_count", (10 ** 9, V.UINT32), r"block_count is 1000000000, expected an integer from 1 to 512"),
    ("llama.block_count", (0, V.UINT32), r"block_count is 0, expected an integer from 1 to 512"),
    ("llama.block_count", (500, V.UINT32), r"block_count is 500, but the file holds 20 tensors"),
    ("llama.expert_used_count", (2, V.UINT32), r"expert_used_count is 2, but the model has no experts"),
    ("llama.attention.head_count_kv", (3, V.UINT32), r"4 attention heads do not split into groups of 3"),
    ("llama.vocab_size", (32, V.UINT32), r"lists 64 tokens for a vocabulary of 32"),
    ("llama.rope.scaling.type", ("bogus", V.STRING), r"rope\.scaling\.type is 'bogus'"),
    ("tokenizer.ggml.token_type", ([1] * 10, V.ARRAY, V.INT32), r"token_type has 10 entries for 64 tokens"),
    ("tokenizer.ggml.scores", (["x"] * 64, V.ARRAY, V.STRING), r"scores is an array of string, expected .*float32"),
    ("tokenizer.ggml.tokens", (7, V.UINT32), r"tokens is a uint32, expected an array of strings"),
    ("general.alignment", (3, V.UINT32), r"alignment 3 is not a power of two"),
])
def test_ill_formed_metadata_is_refused(tmp_path, embedded_path, key, value, pattern):
    t0 = time.monotonic()
    refused(bad(tmp_path, embedded_path, set_fields={key: value}), pattern)
    assert time.monotonic() - t0 < 5  # a billion-layer count is refused, not looped over


@pytest.mark.parametrize("fields, pattern", [
    ({"llama.attention.head_count": ([4, 2], V.ARRAY, V.UINT32)}, r"head_count differs between layers"),
    ({"llama.rope.scaling.type": ("yarn", V.STRING), "llama.rope.scaling.factor": (4.0, V.FLOAT32)},
     r"'yarn', which the torch backend does not implement"),
    ({"llama.expert_count": (8, V.UINT32), "llama.expert_used_count": (2, V.UINT32)}, r"mixture-of-experts"),
    ({"llama.attention.value_length": (16, V.UINT32)}, r"value_length is 16, not the head size 8"),
    ({"llama.rope.dimension_count": (4, V.UINT32)}, r"dimension_count is 4, not the head size 8"),
])
def test_metadata_the_torch_decoder_cannot_run_is_refused(tmp_path, embedded_path, fields, pattern):
    refused(bad(tmp_path, embedded_path, set_fields=fields), pattern)


def test_uniform_per_layer_array_and_linear_scaling_are_read(tmp_path, embedded_path):
    cfg, _, _ = load_gguf(bad(tmp_path, embedded_path, set_fields={
        "llama.attention.head_count": ([4, 4], V.ARRAY, V.UINT32), "llama.rope.scaling.factor": (2.0, V.FLOAT32)}))
    assert cfg.n_heads == 4 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# --- tensors -----------------------------------------------------------------------------------------

def test_wrong_tensor_shape_is_refused(tmp_path, embedded_path):
    k = np.zeros((32, 32), np.float32)  # a K projection as wide as Q: the config says 2 KV heads of 8
    refused(bad(tmp_path, embedded_path, edit_tensors={"blk.1.attn_k.weight": (k, None)}),
            r"tensor blk\.1\.attn_k\.weight has shape \[32, 32\], the configuration needs \[32, 16\]$")


def test_missing_and_unknown_tensors_are_refused(tmp_path, embedded_path):
    refused(bad(tmp_path, embedded_path, edit_tensors={"blk.1.ffn_down.weight": None}),
            r"weights incomplete, 1 tensors missing \(first: blk\.1\.ffn_down\.weight\)$")
    refused(bad(tmp_path, embedded_path, edit_tensors={"blk.0.attn_q_norm.weight": (np.ones(8, np.float32), None)}),
            r"tensor blk\.0\.attn_q_norm\.weight is not part of a llama model$")
    refused(bad(tmp_path, embedded_path, edit_tensors={"blk.2.attn_norm.weight": (np.ones(32, np.float32), None)}),
            r"tensor blk\.2\.attn_norm\.weight is not part of a llama model$")


def test_tensor_type_gguf_cannot_dequantize_is_refused(tmp_path, embedded_path):
    refused(bad(tmp_path, embedded_path, edit_tensors={"output_norm.weight": (np.ones(32, np.int32), None)}),
            r"tensor output_norm\.weight has unsupported type I32$")


# --- absurd header counts and sizes, truncation ---------------------------------------------------------

def test_absurd_counts_and_lengths_are_refused_before_use(tiny, tmp_path):
    raw = tiny.read_bytes()
    u64 = lambda n: struct.pack("<Q", n)  # noqa: E731
    cases = [
        (8, u64(2 ** 40), r"claims 1099511627776 tensors, more than a file of \d+ bytes can hold"),
        (16, u64(2 ** 62), r"claims 4611686018427387904 metadata entries"),
        (value_at(raw, "tokenizer.ggml.tokens") + 4, u64(2 ** 61), r"tokenizer\.ggml\.tokens claims \d+ strings"),
        (value_at(raw, "tokenizer.ggml.token_type") + 4, u64(2 ** 61), r"token_type claims \d+ elements"),
        (value_at(raw, "general.name"), u64(2 ** 63), r"truncated GGUF header: value of general\.name"),
        (raw.index(b"general.type") - 8, u64(70000), r"metadata key #1 at byte \d+ claims 70000 bytes"),
    ]
    for at, data, pattern in cases:
        t0 = time.monotonic()
        refused(patched(tiny, tmp_path / "bad.gguf", at, data), pattern)
        assert time.monotonic() - t0 < 5, pattern


def test_dimension_product_beyond_the_file_is_refused(tiny, tmp_path):
    raw = tiny.read_bytes()
    dims = raw.index(b"token_embd.weight") + len("token_embd.weight") + 4
    # 2^32 x 2^32 elements: 2^64, which wraps to 0 in 64-bit arithmetic
    refused(patched(tiny, tmp_path / "bad.gguf", dims, struct.pack("<QQ", 2 ** 32, 2 ** 32)),
            r"truncated GGUF file: tensor token_embd\.weight \(4294967296x4294967296 Q8_0\) ends at byte \d+")
    refused(patched(tiny, tmp_path / "bad.gguf", dims - 4, struct.pack("<I", 5)), r"has 5 dimensions")


def test_truncated_files_are_one_clear_line(tiny, tmp_path):
    raw = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:-100])
    refused(cut, r"truncated GGUF file: tensor output_norm\.weight \(32 F32\) ends at byte \d+, "
                 r"the file has \d+ bytes$")
    cut.write_bytes(raw[:600])
    refused(cut, r"truncated GGUF header: ")
    cut.write_bytes(raw[:10])
    refused(cut, r"not a GGUF file \(10 bytes\)$")


def test_duplicate_key_is_refused(tiny, tmp_path):
    raw = tiny.read_bytes()
    refused(patched(tiny, tmp_path / "bad.gguf", raw.index(b"general.basename"), b"general.finetune"),
            r"key 'general.finetune' appears twice$")


# --- the llama.cpp backend checks the same before llama.cpp sees the file ----------------------------------

def test_llamacpp_load_checks_first(tmp_path, embedded_path, tiny):
    """An unknown RoPE scaling name, a block count of 0 or over 512, more experts used than exist: each makes
    llama.cpp abort the process (GGML_ASSERT in load_hparams), for any architecture. The check must refuse
    them before ``llama_model_load_from_file`` runs."""
    from zoomr.backends.llamacpp.runtime import load_model

    refused(bad(tmp_path, embedded_path, set_fields={"llama.rope.scaling.type": ("bogus", V.STRING)}),
            "rope.scaling.type is 'bogus'", loader=load_model)
    phi3 = write_tiny_gguf(tmp_path / "phi3.gguf", embedded_path, arch="phi3",
                           set_fields={"phi3.block_count": (600, V.UINT32)})
    refused(phi3, r"phi3\.block_count is 600, expected an integer from 1 to 512$", loader=load_model)
    moe = bad(tmp_path, embedded_path, set_fields={"llama.expert_count": (4, V.UINT32),
                                                   "llama.expert_used_count": (5, V.UINT32)})
    refused(moe, r"expert_used_count is 5, expected 1 to expert_count 4$", loader=load_model)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-100])
    refused(cut, "truncated GGUF file", loader=load_model)


# --- HF directories --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tiny(tiny, tmp_path_factory) -> Path:
    return hf_dir_from_gguf(tiny, tmp_path_factory.mktemp("hf"))


def hf_variant(src: Path, dst: Path, edit=None, drop=(), tensors=None) -> Path:
    """A copy of the HF directory with config.json edited (``edit`` set, ``drop`` removed) and/or the
    weights replaced."""
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(edit or {})
    for k in drop:
        cfg.pop(k, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_hf_dir_loads(hf_tiny, tiny):
    cfg, tensors, _ = load_hf_dir(hf_tiny)
    gcfg, gtensors, _ = load_gguf(tiny)
    assert cfg.n_layers == gcfg.n_layers and set(tensors) == set(gtensors)


@pytest.mark.parametrize("edit, drop, pattern", [
    ({}, ("hidden_size",), r"config\.json lacks hidden_size$"),
    ({"num_attention_heads": "4"}, (), r"num_attention_heads is '4', expected an integer >= 1$"),
    ({"model_type": "qwen2"}, ("rope_theta",), r"config\.json lacks rope_theta$"),
    ({"hidden_act": "gelu"}, (), r"hidden_act 'gelu' is not implemented"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, (), r"RoPE scaling 'yarn' is not implemented"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (),
     r"RoPE scaling 'llama3' needs low_freq_factor \(a number > 0\), got None$"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, (), r"RoPE scaling 'linear' needs factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, (), r"rope_parameters \('default'\) and rope_scaling "
                                                                 r"\('llama3'\) disagree; keep one of them$"),
    ({"num_hidden_layers": 10 ** 9}, (), r"num_hidden_layers is 1000000000, but the weights hold \d+ tensors$"),
    ({"num_key_value_heads": 1}, (), r"tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 32\], "
                                     r"the configuration needs \[8, 32\]$"),
    ({"tie_word_embeddings": False}, (), r"weights incomplete, 1 tensors missing \(first: lm_head\.weight\)$"),
])
def test_bad_hf_config_is_refused_before_weights_load(hf_tiny, tmp_path, edit, drop, pattern):
    d = hf_variant(hf_tiny, tmp_path / "hf", edit, drop)
    with pytest.raises(ModelLoadError, match=pattern) as e:
        load_hf_dir(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_hf_config_that_is_no_object_or_no_json(hf_tiny, tmp_path):
    d = hf_variant(hf_tiny, tmp_path / "hf")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="is not a JSON object$"):
        load_hf_dir(d)
    (d / "config.json").write_bytes(b"\xff{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_hf_dir(d)


@pytest.mark.parametrize("key, default", [("rms_norm_eps", 1e-6), ("rope_theta", 10000.0)])
def test_hf_defaults_are_announced(hf_tiny, tmp_path, capsys, key, default):
    cfg, _, _ = load_hf_dir(hf_variant(hf_tiny, tmp_path / "hf", drop=(key,)))
    assert {"rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta}[key] == default
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoomr: warning: ") and key in err[0], err


def test_hf_tensor_dtypes(hf_tiny, tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(hf_tiny / "model.safetensors"))
    ints = {**tensors, "model.norm.weight": np.ones(32, np.int64)}
    with pytest.raises(ModelLoadError, match=r"tensor model\.norm\.weight has dtype I64"):
        load_hf_dir(hf_variant(hf_tiny, tmp_path / "a", tensors=ints))
    # a buffer the decoder never reads (old checkpoints saved position ids) is skipped, not refused
    extra = {**tensors, "model.position_ids": np.arange(8, dtype=np.int64)}
    _, loaded, _ = load_hf_dir(hf_variant(hf_tiny, tmp_path / "b", tensors=extra))
    assert "model.position_ids" not in loaded


def test_corrupt_safetensors_header_is_one_line(hf_tiny, tmp_path):
    d = hf_variant(hf_tiny, tmp_path / "hf")
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[:8] = struct.pack("<Q", 2 ** 40)  # header length far beyond the file
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt safetensors file"):
        load_hf_dir(d)


# --- no pickle, no remote code ----------------------------------------------------------------------------

SOURCE_DIRS = ("backends", "kvstore", "zoomr_cli", "configs")
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "shelve", "torch.serialization"}


def risky_uses(tree) -> list[str]:
    """Code (not prose) that could unpickle or run a model repository's code."""
    import ast

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("trust_remote_code", "allow_pickle", "weights_only"):
            hits.append(f"{node.arg}=")
        elif isinstance(node, (ast.Name, ast.Attribute)) and getattr(node, "id", getattr(node, "attr", None)) in (
                "trust_remote_code", "from_pretrained"):
            hits.append(ast.unparse(node))
        elif isinstance(node, ast.Constant) and node.value == "trust_remote_code":
            hits.append(repr(node.value))
        elif isinstance(node, ast.Import):
            hits += [a.name for a in node.names if a.name in UNPICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in UNPICKLING_MODULES:
            hits.append(node.module)
        elif (isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name)
              and node.value.id in ("torch", "np", "numpy")):
            hits.append(ast.unparse(node))
    return hits


def test_no_pickle_and_no_remote_code_anywhere_in_the_package():
    """Weights come from GGUF and safetensors only: nothing unpickles (no torch.load/np.load, no pickle
    imports), nothing runs a model repository's code (no trust_remote_code, no from_pretrained); the hub
    download fetches no pickle formats."""
    import ast

    hits = [f"{p.relative_to(ROOT)}: {h}" for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
            for h in risky_uses(ast.parse(p.read_text()))]
    assert not hits, hits
    assert not [p for p in HF_FILE_PATTERNS if re.search(r"\.(bin|pt|pth|pkl|ckpt)\b|^\*$", p)], HF_FILE_PATTERNS
    # the checker itself finds what it is meant to find
    probe = ("import pickle\nfrom transformers import AutoModel\n"
             "AutoModel.from_pretrained('x', trust_remote_code=True)\ntorch.load(f)\nnp.load(f, allow_pickle=True)\n")
    assert sorted(risky_uses(ast.parse(probe))) == ["AutoModel.from_pretrained", "allow_pickle=", "np.load", "pickle",
                                                     "torch.load", "trust_remote_code="]


# --- chat templates --------------------------------------------------------------------------------------

class _Tok:
    bos_text, eos_text = "<s>", "</s>"

    def __init__(self, template):
        self.chat_template = template


MSGS = [{"role": "user", "content": "hi"}]


def test_templates_render_in_the_immutable_sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert isinstance(_env(), ImmutableSandboxedEnvironment)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat(_Tok("{{ ''.__class__.__mro__ }}"), MSGS)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat(_Tok("{% set _ = messages.append(1) %}"), MSGS)


def test_template_size_limit():
    ok = "x" * (MAX_TEMPLATE_BYTES - 8) + "{{ 1 }}"
    assert render_chat(_Tok(ok), MSGS).endswith("x1")
    with pytest.raises(ChatTemplateError, match=r"chat template of 65537 bytes exceeds the 64 KiB limit"):
        render_chat(_Tok("x" * (MAX_TEMPLATE_BYTES + 1)), MSGS)


@pytest.mark.parametrize("template, pattern", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 'a' + 1 }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", r"range\(\) exceed 100000"),
    ("{{ 'x' * 10 ** 9 }}", "repetition of 1000000000 items"),
    ("{{ 7 ** 99999999 }}", r"7 \*\* 99999999 is too large"),
    ("{% for %}", "does not render"),
    ("{{ raise_exception('no system role') }}", "chat template: no system role$"),
])
def test_template_errors_are_one_line(template, pattern):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=pattern) as e:
        render_chat(_Tok(template), MSGS)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 5


# --- through the CLI -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_refuses_bad_gguf_with_one_line(embedded_path, tmp_path):
    """A copy of the embedded model whose RMS epsilon key is renamed (so absent): one line, exit 2, on the
    default (torch) backend; an unknown RoPE scaling name (which aborts llama.cpp) on the llama.cpp one."""
    raw = bytearray(embedded_path.read_bytes())
    key = b"llama.attention.layer_norm_rms_epsilon"
    at = raw.index(key)
    raw[at:at + len(key)] = key[:-1] + b"X"
    (tmp_path / "bad.gguf").write_bytes(bytes(raw))
    r = zoomr("solve", "-m", str(tmp_path / "bad.gguf"), "-p", "hi", "--no-live")
    assert_one_line_error(r)
    assert "bad.gguf: GGUF metadata lacks llama.attention.layer_norm_rms_epsilon" in r.stderr
    raw[at:at + len(key)] = key
    at = raw.index(b"tokenizer.chat_template")
    raw[at:at + 23] = b"llama.rope.scaling.type"  # same length: the template text becomes the scaling name
    (tmp_path / "abort.gguf").write_bytes(bytes(raw))
    r = zoomr("solve", "--backend", "llamacpp", "-m", str(tmp_path / "abort.gguf"), "-p", "hi", "--no-live")
    assert_one_line_error(r)
    assert re.search(r"abort\.gguf: GGUF metadata llama\.rope\.scaling\.type is .\{% for message.{20,60}\.\.\. \(known",
                     r.stderr), r.stderr


# --- fuzzing -----------------------------------------------------------------------------------------
# Bounded and derandomized (the same inputs every run): a fixed number of examples, each under a timer.

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_EXAMPLES = 400
HEADER_SPAN = 1024  # the mutated bytes: version, counts, general.*, the sizes, the tokenizer's first keys
BOUNDARIES = [0, 1, 2, 7, 255, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62, 2 ** 63, 2 ** 64 - 1]
_mutation = st.one_of(
    st.tuples(st.just("B"), st.integers(0, HEADER_SPAN - 1), st.integers(0, 255)),
    st.tuples(st.just("I"), st.integers(0, HEADER_SPAN - 4), st.sampled_from([b % 2 ** 32 for b in BOUNDARIES])),
    st.tuples(st.just("Q"), st.integers(0, HEADER_SPAN - 8), st.sampled_from(BOUNDARIES)),
)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("no result within the per-input limit")


def mutate(raw: bytes, mutations, cut) -> bytes:
    out = bytearray(raw)
    for fmt, at, value in mutations:
        struct.pack_into("<" + fmt, out, at, value)
    return bytes(out[:cut] if cut is not None else out)


def test_fuzz_gguf_header_mutations(tiny, tmp_path_factory):
    """Random byte, u32 and u64 overwrites of the first KiB of the header (and random truncations): every
    input loads or is refused with one ModelLoadError line; nothing else is raised, nothing hangs
    (5 s per input), and allocation peaks stay under 256 bytes per byte of the file (the worst ggml type
    dequantizes 18 bytes into 128 float32s)."""
    import signal
    import tracemalloc

    raw = tiny.read_bytes()
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    counts = {"loaded": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_mutation, min_size=1, max_size=6), st.one_of(st.none(), st.integers(0, len(raw))))
    def one(mutations, cut):
        data = mutate(raw, mutations, cut)
        path.write_bytes(data)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, 5)
        tracemalloc.start()
        try:
            load_gguf(path)
            counts["loaded"] += 1
        except ModelLoadError as e:
            assert "\n" not in str(e) and str(e).startswith(str(path)), str(e)
            counts["refused"] += 1
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert peak < 256 * max(len(data), 4096), peak

    t0 = time.monotonic()
    one()
    print(f"\nGGUF header fuzz: {sum(counts.values())} inputs, {counts['loaded']} loaded, {counts['refused']} refused "
          f"with one line, {time.monotonic() - t0:.1f} s")
    assert sum(counts.values()) >= FUZZ_EXAMPLES and counts["loaded"] and counts["refused"]


LLAMACPP_FUZZ_EXAMPLES = 600
_LLAMACPP_CHILD = textwrap.dedent("""
    import json, random, struct, sys
    from pathlib import Path
    import llama_cpp
    from zoomr.backends.llamacpp.runtime import load_model
    from zoomr.backends.models import ModelLoadError
    from zoomr.backends.tokenizer import LlamaCppTokenizer
    from zoomr.backends.torch.weights import load_gguf

    raw, n, path = Path(sys.argv[1]).read_bytes(), int(sys.argv[2]), Path(sys.argv[3])
    bounds, span = json.loads(sys.argv[4]), int(sys.argv[5])
    rng = random.Random(0)
    counts = dict.fromkeys(["checked_out", "llama_refused", "llama_loaded", "tokenizer_loaded", "torch_refused"], 0)
    for i in range(n):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            fmt = rng.choice("BIQ")
            value = rng.randrange(256) if fmt == "B" else rng.choice(bounds) % (2 ** 32 if fmt == "I" else 2 ** 64)
            struct.pack_into("<" + fmt, data, rng.randrange(span - struct.calcsize(fmt)), value)
        if rng.random() < 0.3:
            data = data[:rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        print(i, flush=True)  # the last index printed names the input of a crash
        try:
            llama_cpp.llama_model_free(load_model(path, n_gpu_layers=0))
            counts["llama_loaded"] += 1
        except ModelLoadError:
            counts["checked_out"] += 1
        except ValueError:
            counts["llama_refused"] += 1
        try:  # the torch backend's path: its own checks, then llama.cpp reads the vocabulary only
            load_gguf(path)
            LlamaCppTokenizer(path)
            counts["tokenizer_loaded"] += 1
        except ValueError:
            counts["torch_refused"] += 1
    print(json.dumps(counts))
""")


def test_fuzz_llamacpp_never_sees_a_header_that_crashes_it(tiny, tmp_path):
    """The same kind of mutations, through the llama.cpp backend's loader and the torch backend's tokenizer
    in a child process: llama.cpp either loads the file or refuses it, the interpreter never dies (an
    abort or a segfault would end the child with a signal)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _LLAMACPP_CHILD, str(tiny), str(LLAMACPP_FUZZ_EXAMPLES),
                        str(tmp_path / "m.gguf"), json.dumps(BOUNDARIES), str(HEADER_SPAN)],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, f"child died ({r.returncode}) on input #{lines[-1] if lines else '?'}: {r.stderr[-2000:]}"
    counts = json.loads(lines[-1])
    print(f"\nllama.cpp fuzz: {LLAMACPP_FUZZ_EXAMPLES} inputs, {counts} in {time.monotonic() - t0:.1f} s")
    assert counts["checked_out"] + counts["llama_refused"] + counts["llama_loaded"] == LLAMACPP_FUZZ_EXAMPLES
    assert counts["llama_loaded"] and counts["checked_out"]


HF_KEYS = ["model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
           "intermediate_size", "vocab_size", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
           "max_position_embeddings", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8) | st.sampled_from(["llama", "qwen2", "mistral", "silu", "linear", "llama3", "yarn"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["rope_type", "factor", "type",
                                                                                "rope_theta"]), inner, max_size=3),
    max_leaves=6)


def test_fuzz_hf_config_values(hf_tiny):
    """Random JSON values for the keys config.json parsing reads (over the valid tiny config): a validated
    ModelConfig or one ValueError line, nothing else."""
    from zoomr.backends.torch.config import ModelConfig

    base = json.loads((hf_tiny / "config.json").read_text())
    counts = {"parsed": 0, "refused": 0}

    @settings(max_examples=300, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(HF_KEYS), _json, max_size=4), st.lists(st.sampled_from(HF_KEYS), max_size=2))
    def one(edits, drops):
        cfg = {**base, **edits}
        for k in drops:
            cfg.pop(k, None)
        try:
            c = ModelConfig.from_hf(cfg)
            assert c.n_heads % c.n_kv_heads == 0 and c.head_dim % 2 == 0
            counts["parsed"] += 1
        except ValueError as e:
            assert "\n" not in str(e), str(e)
            counts["refused"] += 1

    one()
    print(f"\nconfig.json fuzz: {sum(counts.values())} inputs, {counts}")
    assert counts["parsed"] and counts["refused"]


_TEMPLATE_PIECES = st.sampled_from([
    "{{ ", " }}", "{% ", " %}", "{%- ", " -%}", "for m in messages", "endfor", "if ", "endif", "else", "set x = ",
    "m['content']", "m.role", "messages[0]", "messages|length", "range(", ")", "(", "[", "]", " * ", " ** ", " + ",
    " / ", " % ", "99999", "-1", "'a'", "\"", "bos_token", "eos_token", "add_generation_prompt", "raise_exception(",
    "macro f()", "endmacro", "f()", "|tojson", "|upper", ".__class__", "loop.index", "strftime_now('%Y')", "~", "x"])


def test_fuzz_random_chat_templates():
    """Random templates from Jinja fragments and text: a rendered string or one ChatTemplateError line,
    within 5 s each, never another exception."""
    import signal

    counts = {"rendered": 0, "refused": 0}

    @settings(max_examples=400, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_TEMPLATE_PIECES | st.text(max_size=4), max_size=24).map("".join))
    def one(template):
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, 5)
        try:
            assert isinstance(render_chat(_Tok(template), MSGS), str)
            counts["rendered"] += 1
        except ChatTemplateError as e:
            assert "\n" not in str(e), str(e)
            counts["refused"] += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    one()
    print(f"\nchat template fuzz: {sum(counts.values())} inputs, {counts}")
    assert counts["rendered"] and counts["refused"]
