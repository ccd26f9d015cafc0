"""Weights ggml's CPU backend repacks (Q4_0 here; Q4_K, IQ4_NL, Q2_K too): copied once into its interleaved layout,
as llama.cpp loads them, multiplied by its GEMV/GEMM kernels. The same products as the file's layout to fp32
rounding, and still each row on its own: a sequence's bits do not depend on its batch-mates.

The Q4_0 file is the embedded model re-quantized by llama.cpp's own quantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zoomr.backends.torch import ggml_ops
from zoomr.backends.torch.ggml_layers import GgmlLinear, RawWeight
from zoomr.backends.torch.ggml_ops import PackedWeight
from zoomr.backends.torch.weights import load_gguf
from zoomr.evaluation.parity import agreement

from conftest import assert_as_faithful_as_llamacpp, decode_alone_and_batched, zoomr

pytestmark = pytest.mark.skipif(not ggml_ops.available(), reason="llama-cpp-python's ggml cannot be loaded here")


@pytest.fixture(scope="module")
def q4_0_path(tmp_path_factory, embedded_path):
    from zoomr.backends.llamacpp.requantize import requantize

    return requantize(embedded_path, tmp_path_factory.mktemp("q4_0") / "smollm2-Q4_0.gguf", "Q4_0")


@pytest.fixture(scope="module")
def q4_0_tensors(q4_0_path):
    _, tensors, _ = load_gguf(q4_0_path, raw=True)
    w = tensors["model.layers.2.mlp.up_proj.weight"]
    assert isinstance(w, RawWeight) and w.type_name == "Q4_0"
    if PackedWeight.of(w.data, w.ggml_type, w.shape) is None:
        pytest.skip("this CPU has no repacked Q4_0 layout in ggml (x86 without AVX2?)")
    return tensors


def _backend(path, monkeypatch, repack: bool, quant: str = "ggml"):
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend

    monkeypatch.setenv("ZOOMR_GGML_REPACK", "1" if repack else "0")
    be = TorchBackend(resolve_model(str(path)), device="cpu", quant=quant, dtype="fp32", n_ctx=1024, threads=1)
    monkeypatch.delenv("ZOOMR_GGML_REPACK")
    return be


def test_repacked_products_equal_the_files_layout_and_rows_stay_apart(q4_0_tensors, monkeypatch):
    w = q4_0_tensors["model.layers.2.mlp.up_proj.weight"]
    packed = GgmlLinear([w], None, n_threads=1)
    monkeypatch.setenv("ZOOMR_GGML_REPACK", "0")
    plain = GgmlLinear([w], None, n_threads=1)
    assert packed.kind == "ggml (Q4_0 repacked)" and plain.kind == "ggml (Q4_0)"
    assert plain.nbytes() == w.data.nbytes and packed.nbytes() >= w.data.nbytes
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(3))
    got, ref = packed(x), plain(x)
    # the same Q4_0 × Q8_0 integer products; only the order the blocks' float partial sums are added differs
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    # rows 0..3 go through the 4-row GEMM kernel in a batch and the GEMV kernel alone: the same bits
    for n in (1, 2, 3, 4, 5, 8):
        assert torch.equal(packed(x[:n]), got[:n]), n


def test_types_without_a_repacked_layout_stay_in_place(q4_0_tensors, embedded_path, monkeypatch):
    _, tensors, _ = load_gguf(embedded_path, raw=True)
    w = tensors["model.layers.0.mlp.down_proj.weight"]    # Q4_1: no repacked layout in ggml's CPU backend
    assert w.type_name == "Q4_1" and PackedWeight.of(w.data, w.ggml_type, w.shape) is None
    head = q4_0_tensors["model.embed_tokens.weight"]       # Q8_0 on x86 neither
    assert head.type_name == "Q8_0" and PackedWeight.of(head.data, head.ggml_type, head.shape) is None
    q = q4_0_tensors["model.layers.2.mlp.up_proj.weight"]
    monkeypatch.setenv("ZOOMR_GGML_REPACK", "0")
    assert PackedWeight.of(q.data, q.ggml_type, q.shape) is None


@pytest.mark.slow
def test_a_repacked_model_is_as_faithful_as_llamacpp_and_alone_as_in_a_batch(q4_0_path, q4_0_tensors, monkeypatch):
    """Teacher-forced over 512 tokens of GSM8K text against llama.cpp on the same file (which repacks it too) and
    the same weights in fp32. Measured on AVX512: repacked vs llama.cpp top-1 0.9805, KL 0.00334, vs fp32 0.9824,
    0.00266; the file's layout 0.9766, 0.00326 and 0.9746, 0.00263; llama.cpp vs fp32 0.9824, 0.00222."""
    from zoomr.evaluation.parity import gsm8k_text_ids, llamacpp_logits

    packed, exact = _backend(q4_0_path, monkeypatch, True), _backend(q4_0_path, monkeypatch, True, quant="none")
    assert "weights ggml (Q4_0 repacked), head ggml (Q8_0)" in packed.describe(), packed.describe()
    ids = gsm8k_text_ids(packed.tokenizer, 512)
    ours = packed.prefill(packed.new_sequence(), ids, all_logits=True)
    ref = exact.prefill(exact.new_sequence(), ids, all_logits=True)
    assert_as_faithful_as_llamacpp(ours, llamacpp_logits(q4_0_path, ids), ref, "Q4_0 repacked")
    # a step of one row, and of five (the repacked GEMM over 4 rows, GEMV over the 5th): the same bits
    alone, batched = decode_alone_and_batched(packed, [list(range(300 + i, 420 + 29 * i)) for i in range(5)])
    np.testing.assert_array_equal(alone, batched)


def test_the_cli_says_the_weights_were_repacked(q4_0_path, q4_0_tensors):
    r = zoomr("solve", "-m", str(q4_0_path), "-p", "2+2=", "-n", "2", "--quant", "ggml")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "weights ggml (Q4_0 repacked), head ggml (Q8_0)" in out, out
    assert "repack tensor" not in out   # ggml's own debug log stays quiet


def test_requantizing_is_quiet(tmp_path, embedded_path):
    """llama.cpp's quantizer logs every tensor it writes (300+ lines on stderr): silenced, in a fresh process."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from zoomr.backends.llamacpp.requantize import requantize; "
            "print(requantize(Path(sys.argv[1]), Path(sys.argv[2]), 'Q4_0'))")
    r = subprocess.run([sys.executable, "-c", code, str(embedded_path), str(tmp_path / "q.gguf")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "q.gguf").stat().st_size > 10_000_000, r.stderr[-500:]
    assert r.stderr == "", r.stderr[:500]
