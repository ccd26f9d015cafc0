"""Qwen3 and Llama 3.x in the torch backend: GGUF files against llama.cpp, refusals by name.

The files are ``gguf_tiny``'s model (the embedded model's header, sizes shrunk) written with the ``gguf``
package: a ``qwen3`` one (per-head q/k RMSNorm, head size 16 where hidden / heads is 8) and a ``llama`` one
carrying the ``rope_freqs`` tensor that llama.cpp's converter writes for Llama 3.1+'s "llama3" RoPE scaling.
Each is teacher-forced through our decoder (fp32) and through llama.cpp over the same 512 token ids; each
parity test also shows that the feature it checks moves llama.cpp's answer, so a decoder without it fails.
Then: what either architecture cannot run is refused by name (loader and CLI), and the q/k norms hold in
every attention path (batched, padded, cascade, compiled). The transformers reference for HF directories is
``test_hf_reference.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType as V

from zoomr.backends.models import ModelLoadError
from zoomr.backends.torch.model import Decoder
from zoomr.backends.torch.rope import inv_frequencies
from zoomr.backends.torch.weights import load_gguf, load_hf_dir, unpermute_qk, write_hf_dir
from zoomr.evaluation.parity import agreement, llamacpp_logits
from zoomr.kvstore.base import FullKVCache

from conftest import assert_one_line_error, zoomr
from gguf_tiny import N_TOKENS, QWEN3_HEAD, hf_dir_from_gguf, llama3_rope_freqs, write_tiny_gguf

N = 512  # teacher-forced positions, far past the llama3 file's original context of 32
IDS = [int(i) for i in np.random.default_rng(1).integers(3, N_TOKENS, size=N)]
# the "llama3" file: a small RoPE base and original context, so that over N positions the slowed frequencies
# turn far from plain RoPE; its divisors are [1, 6.78, 8, 8]: kept, smoothed and fully scaled frequencies
LLAMA3 = dict(theta=500.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_ctx=32)
# attention sharp enough that RoPE and the q/k norms move the top-1 token (gguf_tiny.tensors)
ATTN_STD = {"qwen3": 0.4, "llama3": 0.6}


def decoder_logits(cfg, tensors, ids: list[int] = IDS) -> np.ndarray:
    """Our fp32 decoder's [T, vocab] logits, every position of ``ids`` in one prefill."""
    dec = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    return dec.forward(torch.tensor(ids), torch.arange(len(ids)), cache, all_logits=True).numpy()


def refused(path: Path, pattern: str, loader=load_gguf) -> None:
    with pytest.raises(ModelLoadError) as e:
        loader(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and re.search(pattern, msg), msg


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, embedded_path) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", embedded_path, arch="qwen3",
                           attn_std=ATTN_STD["qwen3"])


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, embedded_path) -> Path:
    c = LLAMA3
    freqs = llama3_rope_freqs(8, c["theta"], c["factor"], c["low_freq_factor"], c["high_freq_factor"],
                              c["original_ctx"])
    return write_tiny_gguf(tmp_path_factory.mktemp("llama3") / "llama3.gguf", embedded_path,
                           attn_std=ATTN_STD["llama3"], edit_tensors={"rope_freqs.weight": (freqs, None)},
                           set_fields={"llama.rope.freq_base": (c["theta"], V.FLOAT32)})


# --- against llama.cpp -----------------------------------------------------------------------------------

def test_qwen3_gguf_matches_llamacpp(qwen3):
    cfg, tensors, _ = load_gguf(qwen3)
    assert (cfg.arch, cfg.head_dim, cfg.hidden // cfg.n_heads, cfg.attn_bias) == ("qwen3", QWEN3_HEAD, 8, False)
    ref = llamacpp_logits(qwen3, IDS)
    top1, kl = agreement(decoder_logits(cfg, tensors), ref)
    print(f"\nqwen3 GGUF, fp32 vs llama.cpp over {N} tokens: top-1 {top1:.4f}, mean KL {kl:.2e} nats")
    assert top1 >= 0.98
    # llama.cpp applies the norms (with their weights) and does not permute qwen3's Q/K rows: a decoder that
    # skipped either would fail the bound above
    unit = {k: np.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in tensors.items()}
    assert agreement(decoder_logits(cfg, unit), ref)[0] < 0.95
    permuted = {k: unpermute_qk(v, cfg.n_heads if ".q_proj." in k else cfg.n_kv_heads)
                if (".q_proj." in k or ".k_proj." in k) else v for k, v in tensors.items()}
    assert agreement(decoder_logits(cfg, permuted), ref)[0] < 0.95


def test_qwen3_gguf_with_qkv_biases_matches_llamacpp(tmp_path, embedded_path):
    """llama.cpp reads optional q/k/v biases in a qwen3 file (and no output bias): so does the decoder."""
    rng = np.random.default_rng(2)
    biases = {f"blk.{i}.attn_{x}.bias": (rng.normal(0, 0.5, 4 * QWEN3_HEAD if x == "q" else 2 * QWEN3_HEAD)
                                         .astype(np.float32), None) for i in range(2) for x in "qkv"}
    path = write_tiny_gguf(tmp_path / "qwen3b.gguf", embedded_path, arch="qwen3", attn_std=ATTN_STD["qwen3"],
                           edit_tensors=biases)
    cfg, tensors, _ = load_gguf(path)
    assert cfg.attn_bias
    top1, _ = agreement(decoder_logits(cfg, tensors), llamacpp_logits(path, IDS))
    assert top1 >= 0.98
    # transformers' Qwen3 cannot hold these biases without an output one: written out, refused when read back
    write_hf_dir(cfg, tensors, tmp_path / "hf")
    refused(tmp_path / "hf", r"attention_bias is set: the qwen3 output projection's bias is not implemented",
            loader=load_hf_dir)


def test_llama3_rope_freqs_gguf_matches_llamacpp(llama3):
    cfg, tensors, _ = load_gguf(llama3)
    assert cfg.arch == "llama" and cfg.rope_scaling is None and "rope_freqs" in tensors
    ref = llamacpp_logits(llama3, IDS)
    top1, kl = agreement(decoder_logits(cfg, tensors), ref)
    plain = {k: v for k, v in tensors.items() if k != "rope_freqs"}
    top1_plain, kl_plain = agreement(decoder_logits(cfg, plain), ref)
    print(f"\nllama3 rope_freqs GGUF, fp32 vs llama.cpp over {N} tokens: top-1 {top1:.4f}, mean KL {kl:.2e} nats; "
          f"without rope_freqs {top1_plain:.4f}, {kl_plain:.2e}")
    assert top1 >= 0.98
    assert top1_plain < 0.96 and kl_plain > 100 * kl


def test_llama3_rope_freqs_on_the_ggml_path(llama3):
    """``--quant ggml`` hands ``rope_freqs`` to ggml's RoPE as its frequency divisors: the same 512 positions,
    prefilled and then teacher-forced one decode step (one ggml graph) at a time, match llama.cpp; without the
    divisors they do not."""
    from zoomr.backends.torch import ggml_ops

    if not ggml_ops.available():
        pytest.skip("llama-cpp-python's ggml cannot be loaded here")
    cfg, tensors, _ = load_gguf(llama3, raw=True)
    ref = llamacpp_logits(llama3, IDS)
    found = {}
    for name, t in (("rope_freqs", tensors), ("plain", {k: v for k, v in tensors.items() if k != "rope_freqs"})):
        dec = Decoder(cfg, t, torch.device("cpu"), torch.float32, quant="ggml")
        cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
        pre = dec.forward(torch.tensor(IDS), torch.arange(N), cache, all_logits=True).numpy()
        cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
        steps = []
        for p, tok in enumerate(IDS):
            steps.append(dec.forward(torch.tensor([tok]), torch.tensor([p]), cache).numpy())
            cache.end_forward([tok], "")
        found[name] = agreement(pre, ref), agreement(np.stack(steps), ref)
    print(f"\nllama3 rope_freqs GGUF, ggml path vs llama.cpp (prefill, decode steps): {found}")
    assert all(top1 >= 0.98 for top1, _ in found["rope_freqs"]), found
    assert all(top1 < 0.96 for top1, _ in found["plain"]), found


@pytest.mark.parametrize("head_dim, theta, factor, low, high, old", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),    # Llama 3.1 8B / 70B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),    # Llama 3.2 1B
    (8, 500.0, 8.0, 1.0, 4.0, 32),           # the tiny file above
])
def test_rope_freqs_divisors_equal_the_hf_llama3_scaling(head_dim, theta, factor, low, high, old):
    """The GGUF path (llama.cpp's converter's divisors, applied as llama.cpp does) and the HF path (config.json's
    rope_scaling, checked against transformers in test_hf_reference.py) give the same frequencies."""
    hf = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
          "original_max_position_embeddings": old}
    divisors = torch.from_numpy(llama3_rope_freqs(head_dim, theta, factor, low, high, old))
    assert float(divisors.max()) == factor and float(divisors.min()) == 1.0
    torch.testing.assert_close(inv_frequencies(head_dim, theta, None, divisors), inv_frequencies(head_dim, theta, hf),
                               rtol=1e-6, atol=0)


# --- refused by name -------------------------------------------------------------------------------------

def test_qwen3_gguf_without_its_norms_is_refused(tmp_path, embedded_path):
    refused(write_tiny_gguf(tmp_path / "q.gguf", embedded_path, arch="qwen3",
                            edit_tensors={"blk.1.attn_k_norm.weight": None}),
            r"weights incomplete, 1 tensors missing \(first: blk\.1\.attn_k_norm\.weight\)$")
    refused(write_tiny_gguf(tmp_path / "q.gguf", embedded_path, arch="qwen3",
                            edit_tensors={"blk.0.attn_q_norm.weight": (np.ones(8, np.float32), None)}),
            r"tensor blk\.0\.attn_q_norm\.weight has shape \[8\], the configuration needs \[16\]$")


@pytest.mark.parametrize("arch, name, shape", [
    ("qwen3", "rope_freqs.weight", (8,)),            # llama.cpp reads rope_freqs for llama only
    ("qwen2", "rope_freqs.weight", (4,)),
    ("qwen3", "blk.0.attn_output.bias", (32,)),      # no output bias in llama.cpp's qwen3
    ("llama", "blk.0.attn_output.bias", (32,)),      # llama.cpp reads it; the decoder has none
])
def test_tensors_an_architecture_does_not_have_are_refused(tmp_path, embedded_path, arch, name, shape):
    path = write_tiny_gguf(tmp_path / "x.gguf", embedded_path, arch=arch,
                           edit_tensors={name: (np.ones(shape, np.float32), None)})
    refused(path, rf"tensor {re.escape(name)} is not part of a {arch} model$")


@pytest.mark.parametrize("arch, kind", [("llama", "yarn"), ("llama", "longrope"), ("qwen3", "yarn")])
def test_gguf_rope_scaling_the_decoder_lacks_is_refused(tmp_path, embedded_path, arch, kind):
    path = write_tiny_gguf(tmp_path / "s.gguf", embedded_path, arch=arch, set_fields={
        f"{arch}.rope.scaling.type": (kind, V.STRING), f"{arch}.rope.scaling.factor": (4.0, V.FLOAT32)})
    refused(path, rf"GGUF metadata {arch}\.rope\.scaling\.type is '{kind}', which the torch backend does not "
                  r"implement \(--backend llamacpp runs it\)$")


@pytest.fixture(scope="module")
def qwen3_hf(qwen3, tmp_path_factory) -> Path:
    return hf_dir_from_gguf(qwen3, tmp_path_factory.mktemp("qwen3-hf"))


def hf_copy(src: Path, dst: Path, edit: dict | None = None, drop_tensor: str | None = None) -> Path:
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    cfg = {**json.loads((src / "config.json").read_text()), **(edit or {})}
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop(drop_tensor, None)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_qwen3_hf_dir_written_from_gguf_decodes_the_same(qwen3, qwen3_hf):
    cfg, tensors, _ = load_gguf(qwen3)
    hcfg, htensors, _ = load_hf_dir(qwen3_hf)
    assert hcfg == cfg and json.loads((qwen3_hf / "config.json").read_text())["model_type"] == "qwen3"
    np.testing.assert_array_equal(decoder_logits(hcfg, htensors, IDS[:64]), decoder_logits(cfg, tensors, IDS[:64]))


@pytest.mark.parametrize("edit, drop, pattern", [
    ({}, "model.layers.1.self_attn.q_norm.weight",
     r"weights incomplete, 1 tensors missing \(first: model\.layers\.1\.self_attn\.q_norm\.weight\)$"),
    ({"attention_bias": True}, None, r"attention_bias is set: the qwen3 output projection's bias is not implemented"),
    ({"use_sliding_window": True, "sliding_window": 16}, None, r"use_sliding_window is set: sliding-window attention "
                                                             r"is not implemented"),
])
def test_qwen3_hf_dir_the_decoder_cannot_run_is_refused(qwen3_hf, tmp_path, edit, drop, pattern):
    refused(hf_copy(qwen3_hf, tmp_path / "hf", edit, drop), pattern, loader=load_hf_dir)


# --- through the CLI: one line, exit 2 -------------------------------------------------------------------

@pytest.mark.slow
def test_cli_refuses_other_architectures_naming_the_supported_ones(tmp_path, embedded_path, qwen3_hf,
                                                                   hf_tokenizer_dir):
    phi3 = write_tiny_gguf(tmp_path / "phi3.gguf", embedded_path, arch="phi3")
    r = zoomr("solve", "-m", str(phi3), "-p", "hi", "--no-live", "-n", "1")
    assert_one_line_error(r)
    assert (f"{phi3}: unsupported GGUF architecture 'phi3' for the torch backend (supported: llama, qwen2, qwen3; "
            "--backend llamacpp runs more)") in r.stderr, r.stderr
    gpt2 = hf_copy(qwen3_hf, tmp_path / "gpt2", {"model_type": "gpt2"})
    for f in hf_tokenizer_dir.iterdir():
        (gpt2 / f.name).write_bytes(f.read_bytes())
    r = zoomr("solve", "-m", str(gpt2), "-p", "hi", "--no-live", "-n", "1")
    assert_one_line_error(r)
    assert ("unsupported model_type 'gpt2' (supported: llama, mistral, qwen2, qwen3; other architectures run from "
            "a GGUF file with --backend llamacpp)") in r.stderr, r.stderr


def test_cli_refuses_a_qwen3_without_its_norms(tmp_path, qwen3_hf, hf_tokenizer_dir):
    d = hf_copy(qwen3_hf, tmp_path / "hf", drop_tensor="model.layers.0.self_attn.k_norm.weight")
    for f in hf_tokenizer_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    r = zoomr("solve", "-m", str(d), "-p", "hi", "--no-live", "-n", "1")
    assert_one_line_error(r)
    assert "tensors missing (first: model.layers.0.self_attn.k_norm.weight)" in r.stderr, r.stderr


# --- every attention path applies the q/k norms ------------------------------------------------------------

def _qwen3_decode(dec, cfg, attention: str, steps: int = 6) -> np.ndarray:
    """[steps, 4, vocab] logits of four sequences decoded together: three forks of one 40-token prompt with
    own tails of 0-2 tokens, and one unforked sequence of 30 tokens; the same teacher-forced tokens for every
    mode (row b of step s reads ``IDS[200 + 4 s + b]``)."""
    def run(cache, ids: list[int]) -> None:
        dec.forward(torch.tensor(ids), torch.arange(cache.n_tokens, cache.n_tokens + len(ids)), cache)
        cache.end_forward(ids, "")

    parent = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    run(parent, IDS[:40])
    seqs = [parent.fork() for _ in range(3)]
    seqs.append(FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32))
    for c, tail in zip(seqs, [[], [7], [8, 9], IDS[100:130]]):
        if tail:
            run(c, tail)
    rows = []
    for step in range(steps):
        toks = [IDS[200 + 4 * step + b] for b in range(4)]
        pos = torch.tensor([c.n_tokens for c in seqs])
        rows.append(dec.forward_batch(torch.tensor(toks), pos, [1] * 4, seqs, attention=attention).numpy())
        for c, t in zip(seqs, toks):
            c.end_forward([t], "")
    return np.stack(rows)


def test_qwen3_batched_padded_and_cascade_decode_agree(qwen3):
    cfg, tensors, _ = load_gguf(qwen3)
    dec = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    per_seq = _qwen3_decode(dec, cfg, "per_seq")
    np.testing.assert_allclose(_qwen3_decode(dec, cfg, "padded"), per_seq, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_qwen3_decode(dec, cfg, "cascade"), per_seq, atol=2.5e-4, rtol=0)
    # the batch's rows are each sequence's own: the unforked one alone, prefill and steps in one forward
    alone = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    ids = IDS[100:130] + [IDS[200 + 4 * s + 3] for s in range(6)]
    ref = dec.forward(torch.tensor(ids), torch.arange(len(ids)), alone, all_logits=True).numpy()
    np.testing.assert_allclose(per_seq[:, 3], ref[30:], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(not any(__import__("shutil").which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor builds C++ kernels on a CPU")
def test_qwen3_compiled_decode_follows_eager(qwen3):
    """bf16 linears (fp32 KV), as ``--compile`` runs on a CPU by default; in fp32 the packed oneDNN linear does
    not compile (inductor's lowering fails) and decoding falls back to eager, which would test nothing here."""
    from torch._dynamo.utils import counters

    cfg, tensors, _ = load_gguf(qwen3)
    eager = _qwen3_decode(Decoder(cfg, tensors, torch.device("cpu"), torch.bfloat16), cfg, "per_seq")
    compiled = Decoder(cfg, tensors, torch.device("cpu"), torch.bfloat16, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    got = _qwen3_decode(compiled, cfg, "per_seq")
    assert compiled.compiled and counters["stats"]["unique_graphs"] >= graphs + 2   # its own graphs, with the norms
    print(f"\nqwen3 compiled vs eager decode (bf16 linears): max |dlogit| {np.abs(got - eager).max():.4f}")
    # fused kernels round bf16 differently: agreement to bf16's resolution on logits of a few units
    assert np.abs(got - eager).max() < 0.1
    assert (got.argmax(-1) == eager.argmax(-1)).mean() >= 0.9


def test_a_rope_freqs_gguf_is_not_exported_or_fine_tuned_with_plain_rope(llama3, tmp_path):
    """A HF directory cannot carry rope_freqs divisors: writing one (finetune's export, untie_model.py) and
    fine-tuning a Llama 3.1+ GGUF are refused rather than run with plain RoPE afterwards."""
    from zoomr.errors import UserError
    from zoomr.finetune.hf_model import load_weights

    cfg, tensors, _ = load_gguf(llama3)
    with pytest.raises(ValueError, match="rope_freqs"):
        write_hf_dir(cfg, tensors, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="rope_freqs"):
        load_weights(str(llama3))
    write_hf_dir(cfg, {**tensors, "rope_freqs": np.ones_like(tensors["rope_freqs"])}, tmp_path / "plain")
