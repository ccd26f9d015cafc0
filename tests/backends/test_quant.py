"""Quantized weights: GGUF blocks decode exactly, the int kernels compute what the dequantized weights do,
``--quant`` and ``--dtype auto`` resolve as documented."""

import json

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_one_line_error, zoomr
from zoomr.backends.torch import dtype_probe
from zoomr.backends.torch.engine import resolve_quant
from zoomr.backends.torch.quant import (GROUP, DenseLinear, Fp16Linear, GroupQuant, Int4Linear, Int8Linear,
                                        QuantEmbedding, StackedLinear, check_quant, fp16_gemm_available,
                                        from_gguf_blocks, kernel_planes, make_linear, quantize_int4,
                                        regroup_to_32)

CPU = torch.device("cpu")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# byte offsets of each block's fp16 fields (d, m / dmin); every other byte is codes or integer scales
FP16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}
EXACT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]  # Q6_K runs regrouped (nearest)


def random_blocks(type_name: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """[rows, blocks · size] uint8 of valid blocks: random codes and integer scales, fp16 fields of mixed sign
    and size (finite values, not random bit patterns)."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in FP16_AT[type_name]:
        vals = rng.standard_normal((rows, blocks, 1)) * 10.0 ** rng.uniform(-4, -1, (rows, blocks, 1))
        raw[..., at:at + 2] = vals.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("type_name", list(BLOCK_BYTES))
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 9), blocks=st.integers(1, 3))
def test_blocks_decode_exactly_as_gguf_dequantizes(type_name, seed, rows, blocks):
    raw = random_blocks(type_name, rows=rows, blocks=blocks, seed=seed)
    q = from_gguf_blocks(raw, type_name)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    per_block = 256 if type_name.endswith("_K") else GROUP
    assert q.shape == (rows, blocks * per_block) and q.group == (16 if type_name == "Q6_K" else GROUP)
    assert q.codes.min() >= (0 if q.bits == 4 else -128) and q.codes.max() <= (15 if q.bits == 4 else 127)
    np.testing.assert_array_equal(q.dequantize(), ref)
    # the embedding lookup reads the same codes: its rows are the file's too
    np.testing.assert_array_equal(QuantEmbedding(q, CPU)[torch.arange(rows)].numpy(), ref)


def test_embedded_model_blocks_decode_exactly(gguf_weights, embedded_path):
    """The file's own tensors (Q4_1 layers, Q8_0 embedding), Q/K rows unpermuted as for float weights."""
    from zoomr.backends.torch.weights import load_gguf

    _, kept, _ = load_gguf(embedded_path, keep_blocks=True)
    _, floats = gguf_weights
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert isinstance(kept[name], GroupQuant), name
        np.testing.assert_array_equal(kept[name].dequantize(), floats[name])
    assert kept["model.embed_tokens.weight"].source == "Q8_0"
    assert kept["model.layers.0.mlp.up_proj.weight"].source == "Q4_1"


def linear_inputs(K: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((T, K)).astype(np.float32))


@pytest.mark.parametrize("type_name", EXACT_TYPES)
@pytest.mark.parametrize("rows", [48, 37])  # 37: not a multiple of the kernel's 16-row tiles (padded)
def test_int4_kernel_equals_dequantized_matmul_fp32(type_name, rows):
    """fp32 activations hold the scales exactly: the kernel's result is the fp32 matmul of the file's weights
    (one plane for 4-bit codes, two for 5- and 8-bit ones, whose group zero is counted once)."""
    blocks = 1 if type_name.endswith("_K") else 6
    q = from_gguf_blocks(random_blocks(type_name, rows=rows, blocks=blocks, seed=rows), type_name)
    bias = np.random.default_rng(2).standard_normal(rows).astype(np.float32)
    lin = Int4Linear(q, bias, CPU, torch.float32)
    x = linear_inputs(q.shape[1], T=5)
    ref = F.linear(x.double(), torch.from_numpy(q.dequantize()).double(), torch.from_numpy(bias).double())
    got = lin(x)
    assert got.shape == (5, rows)
    scale = float(ref.abs().max())
    np.testing.assert_allclose(got.double().numpy(), ref.numpy(), atol=2e-6 * scale, rtol=0)


def test_two_plane_zeros_carry_the_minimum_past_bf16_rounding():
    """Q5_1/Q5_K minima are ~16 steps: the hi plane holds the minimum rounded to bf16, the lo plane's zero the
    remainder, so the kernel's two bf16 zeros sum to the group's zero within bf16 rounding of 8·s, not of the
    minimum; in fp32 the planes' zeros are the file's values."""
    rng = np.random.default_rng(14)
    d = (np.abs(rng.standard_normal((40, 6))) * 1e-3).astype(np.float16).astype(np.float32)
    m = (-15.5 * d * (1 + 0.1 * rng.standard_normal(d.shape))).astype(np.float16).astype(np.float32)
    q = GroupQuant(rng.integers(0, 32, (40, 6 * GROUP)).astype(np.int16), d, m, GROUP, 8, "Q5_1")
    (_, _, z_hi), (_, _, z_lo) = kernel_planes(q, torch.bfloat16)
    bf = lambda a: torch.from_numpy(a).bfloat16().double().numpy()   # what the kernel holds
    total = bf(z_hi) + bf(z_lo)                                      # the group's kernel zero: m + 8·s
    assert (np.abs(total - (m + 8.0 * d)) <= 8 * d * 2.0 ** -8).all()
    assert (np.abs(bf(m) - m) > 8 * d * 2.0 ** -8).any()             # rounding m alone would miss that bound
    (_, _, z32), (_, _, l32) = kernel_planes(q, torch.float32)
    np.testing.assert_array_equal(z32, m)
    np.testing.assert_array_equal(l32, 8.0 * d)


def test_q6k_regrouped_is_nearest_within_an_eighth_of_a_step():
    """Q6_K's 16-groups as 32-groups: the larger-scaled sub-block exact, the other within half the new step
    (an eighth of the larger Q6_K step), each weight the nearest the group's grid holds; the kernel then runs
    the regrouped values exactly."""
    q6 = from_gguf_blocks(random_blocks("Q6_K", rows=37, blocks=2, seed=11), "Q6_K")
    q = regroup_to_32(q6)
    assert (q.group, q.bits, q.source) == (GROUP, 8, "Q6_K regrouped")
    w6, w = q6.dequantize().reshape(37, -1, 2, 16), q.dequantize().reshape(37, -1, 2, 16)
    sub = np.abs(q6.scale).reshape(37, -1, 2)
    larger = sub[..., 0] >= sub[..., 1]
    step = np.abs(q.scale)[..., None]                                     # [rows, groups, 1]
    err = np.abs(w - w6)
    kept = np.where(larger[..., None], err[:, :, 0], err[:, :, 1])
    other = np.where(larger[..., None], err[:, :, 1], err[:, :, 0])
    np.testing.assert_array_equal(kept, 0)
    assert (other <= step / 2 * (1 + 1e-6)).all() and other.max() > 0
    np.testing.assert_array_equal(step[..., 0], sub.max(-1) / 4)  # a quarter of the larger Q6_K step d·sc
    x = linear_inputs(q.shape[1], T=3)
    ref = F.linear(x.double(), torch.from_numpy(q.dequantize()).double())
    got = make_linear([q6], None, "auto", CPU, torch.float32)(x).double()
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=2e-6 * float(ref.abs().max()), rtol=0)


def test_fused_parts_of_mixed_types_run_as_one_weight():
    """A Q4_K_M file's fused linears: parts of one plane count share a call (Q5_0 Q/K with a Q8_0 V), mixed ones
    run a call per run (Q4_K Q/K with a Q6_K V); either way the output is the stacked weights' matmul, bias
    split with the rows."""
    def part(t, rows, seed):  # K = 256: one super-block, or 8 legacy blocks
        return from_gguf_blocks(random_blocks(t, rows, 1 if t.endswith("_K") else 8, seed=seed), t)
    rng = np.random.default_rng(12)
    for types, n_calls in ((["Q5_0", "Q5_0", "Q8_0"], 1), (["Q4_K", "Q4_K", "Q6_K"], 2),
                           (["Q4_K", "Q6_K", "Q4_1", "Q5_K"], 4)):
        parts = [part(t, r, seed=i) for i, (t, r) in enumerate(zip(types, (48, 16, 21, 8)))]
        bias = rng.standard_normal(sum(p.shape[0] for p in parts)).astype(np.float32)
        lin = make_linear(parts, bias, "auto", CPU, torch.float32)
        assert (isinstance(lin, StackedLinear) and len(lin.parts) == n_calls) or (n_calls == 1 and
                                                                                  isinstance(lin, Int4Linear))
        w = np.concatenate([regroup_to_32(p).dequantize() if p.group != GROUP else p.dequantize() for p in parts])
        x = linear_inputs(w.shape[1], T=4, seed=13)
        ref = F.linear(x.double(), torch.from_numpy(w).double(), torch.from_numpy(bias).double())
        np.testing.assert_allclose(lin(x).double().numpy(), ref.numpy(), atol=2e-6 * float(ref.abs().max()), rtol=0)
        forms = {"Q4_K": "int4 (Q4_K)", "Q4_1": "int4 (Q4_1)", "Q6_K": "int4×2 (Q6_K regrouped)"}
        assert set(lin.kind.split("/")) == {forms.get(t, f"int4×2 ({t})") for t in types}


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q5_K", "Q8_0"])
def test_int4_kernel_bf16_within_bf16_rounding(type_name):
    """bf16: scales and zeros are rounded to bf16 (the kernel's dtype); the error is that of bf16 weights."""
    blocks = 2 if type_name.endswith("_K") else 18
    q = from_gguf_blocks(random_blocks(type_name, rows=64, blocks=blocks, seed=3), type_name)
    x = linear_inputs(q.shape[1], T=3)
    ref = F.linear(x.double(), torch.from_numpy(q.dequantize()).double())
    got = Int4Linear(q, None, CPU, torch.bfloat16)(x.bfloat16()).double()
    dense_bf16 = F.linear(x.bfloat16(), torch.from_numpy(q.dequantize()).bfloat16()).double()
    err, dense_err = float((got - ref).abs().max()), float((dense_bf16 - ref).abs().max())
    assert err <= 2 * dense_err + 1e-6, (err, dense_err)


def test_int8_kernel_equals_its_per_row_weight():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    lin = Int8Linear(w, None, CPU, torch.float32)
    wq = lin.w8.float() * lin.scale[:, None]
    # per-row symmetric rounding: each weight within half a step of the original
    assert float((wq - torch.from_numpy(w)).abs().max(1).values.sub(lin.scale / 2).max()) <= 1e-6
    x = linear_inputs(96, T=4)
    np.testing.assert_allclose(lin(x).numpy(), F.linear(x.double(), wq.double()).numpy(), atol=1e-4, rtol=1e-5)


needs_fbgemm = pytest.mark.skipif(not fp16_gemm_available(CPU), reason="fbgemm's fp16 GEMM is x86-only")


@needs_fbgemm
def test_fp16_kernel_equals_fp32_math_on_fp16_rounded_weights():
    """fp16 weights, fp32 activations: F.linear on the weight rounded to fp16, nothing else rounded; each row
    of a batch the same as alone up to fp32 summation order (no activation quantization couples the rows)."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    lin = Fp16Linear(w, b)
    x = linear_inputs(96, T=5)
    w16 = torch.from_numpy(w).half().double()
    want = F.linear(x.double(), w16, torch.from_numpy(b).double())
    np.testing.assert_allclose(lin(x).double().numpy(), want.numpy(), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(lin(x[2:3]).numpy(), lin(x)[2:3].numpy(), atol=1e-5, rtol=1e-6)  # fp32 order only
    assert lin.nbytes() == 2 * 48 * 96 + 4 * 48 and lin(x).dtype == torch.float32


@needs_fbgemm
@pytest.mark.slow
def test_fp16_weights_run_in_fp32_and_refuse_half_dtypes(embedded_path):
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend, pick_dtype

    assert pick_dtype("auto", CPU, "fp16") == torch.float32 == pick_dtype("fp32", CPU, "fp16")
    with pytest.raises(ValueError, match="--quant fp16 computes in fp32"):
        pick_dtype("bf16", CPU, "fp16")
    be = TorchBackend(resolve_model(None), device="cpu", quant="fp16", n_ctx=64)
    assert be.dtype == torch.float32 and be.model.weight_summary() == "fp16 (fbgemm), head fp16 (fbgemm)"
    dense = TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=64)
    ids = be.tokenizer.encode("Janet has 16 eggs.", special=False)
    a, b = be.prefill(be.new_sequence(), ids, all_logits=True), dense.prefill(dense.new_sequence(), ids, all_logits=True)
    assert (a.argmax(-1) == b.argmax(-1)).all() and np.abs(a - b).max() < 0.05
    r = zoomr("solve", "-p", "hi", "-n", "2", "--quant", "fp16", "--dtype", "bf16")
    assert_one_line_error(r)
    assert "--quant fp16 computes in fp32" in r.stderr


def test_quantize_int4_within_half_a_step():
    w = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    w[3, :32] = 0.25  # a constant group is exact
    q = quantize_int4(w)
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    err = np.abs(q.dequantize() - w).reshape(16, 2, 32).max(-1)
    assert (err <= q.scale / 2 + 1e-6).all()
    assert err[3, 0] == 0


def test_embedding_rows_are_exact():
    q = from_gguf_blocks(random_blocks("Q8_0", rows=50, blocks=3, seed=6), "Q8_0")
    emb = QuantEmbedding(q, CPU)
    ids = torch.tensor([0, 7, 49, 7])
    np.testing.assert_array_equal(emb[ids].numpy(), q.dequantize()[ids.numpy()])


def test_make_linear_modes():
    blocks = from_gguf_blocks(random_blocks("Q4_1", rows=32, blocks=2), "Q4_1")
    dense = np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)
    assert isinstance(make_linear([blocks], None, "auto", CPU, torch.float32), Int4Linear)
    assert isinstance(make_linear([dense], None, "auto", CPU, torch.float32), DenseLinear)
    assert isinstance(make_linear([blocks, dense], None, "int4", CPU, torch.float32), Int4Linear)
    assert isinstance(make_linear([blocks], None, "int8", CPU, torch.float32), Int8Linear)
    assert isinstance(make_linear([blocks], None, "none", CPU, torch.float32), DenseLinear)
    if fp16_gemm_available(CPU):
        assert isinstance(make_linear([blocks, dense], None, "fp16", CPU, torch.float32), Fp16Linear)


def test_quant_resolution():
    assert resolve_quant("auto", "gguf", "auto") == "auto"
    assert resolve_quant("auto", "gguf", "bf16") == "auto"
    assert resolve_quant("auto", "gguf", "fp32") == "none"  # the exact-check dtype runs dense
    assert resolve_quant("auto", "hf", "auto") == "none"
    assert resolve_quant("int4", "hf", "fp32") == "int4"
    with pytest.raises(ValueError, match="--quant 'int3' unknown"):
        check_quant("int3")


def test_dtype_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path))
    first = dtype_probe.cpu_half_dtype("dense")
    assert first in (torch.bfloat16, torch.float16)
    stored = json.loads((tmp_path / "dtype_probe.json").read_text())
    (entry,) = stored.values()
    assert set(entry["ms"]) == {"bf16", "fp16"} and entry["dtype"] in ("bf16", "fp16")
    # the cached answer is the one used: flip it and it is read back, not re-measured
    flipped = "fp16" if entry["dtype"] == "bf16" else "bf16"
    (tmp_path / "dtype_probe.json").write_text(json.dumps({k: {**v, "dtype": flipped} for k, v in stored.items()}))
    assert dtype_probe.cpu_half_dtype("dense") == dtype_probe.CANDIDATES[flipped]


@pytest.mark.slow
def test_quantized_decoder_close_to_dense(embedded_path):
    """The whole model, int4 from the file's blocks with fp32 activations (exact scales), against the dense fp32
    decoder on the same dequantized weights: the same function up to fp32 summation order."""
    from zoomr.backends.torch.model import Decoder
    from zoomr.backends.torch.weights import load_gguf
    from zoomr.kvstore.base import FullKVCache

    cfg, kept, _ = load_gguf(embedded_path, keep_blocks=True)
    ids = torch.tensor([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2])
    out = {}
    for quant in ("auto", "none"):
        dec = Decoder(cfg, kept, CPU, torch.float32, quant=quant)
        cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, CPU, torch.float32)
        out[quant] = dec.forward(ids, torch.arange(len(ids)), cache, all_logits=True).numpy()
        if quant == "auto":
            assert dec.weight_summary() == "int4 (Q4_1), head int4×2 (Q8_0)"
    np.testing.assert_allclose(out["auto"], out["none"], atol=2e-3, rtol=0)


def test_half_precision_head_gives_exact_top_logits(embedded_path):
    """bf16 activations, the file's Q8_0 head in the int4 kernel: per row, the EXACT_TOP_K largest logits are
    the fp32 head's on the same hidden state (the kernel's own bf16 logits are off by up to ~2⁻⁹ of their size),
    the rest keep the kernel's rounding; the tied table is not held twice."""
    from zoomr.backends.torch.head import EXACT_TOP_K, ExactTopHead
    from zoomr.backends.torch.model import Decoder
    from zoomr.backends.torch.weights import load_gguf

    cfg, kept, _ = load_gguf(embedded_path, keep_blocks=True)
    dec = Decoder(cfg, kept, CPU, torch.bfloat16, quant="auto")
    head = dec.lm_head
    assert isinstance(head, ExactTopHead) and head.table is dec.embed
    assert dec.weight_summary() == f"int4 (Q4_1), head int4×2 (Q8_0), top-{EXACT_TOP_K} exact"
    h = linear_inputs(cfg.hidden, 3, seed=9)
    h = h / h.norm(dim=-1, keepdim=True) * 20.0  # hidden states of a final-norm's size: logits of tens
    w = torch.from_numpy(kept["model.embed_tokens.weight"].dequantize())
    exact = h @ w.T
    got = head(h)
    fast = head.fast(h.bfloat16()).float()
    for row in range(3):
        top = fast[row].topk(EXACT_TOP_K).indices  # the candidates the head re-scores
        torch.testing.assert_close(got[row, top], exact[row, top], rtol=0, atol=1e-4)
        assert (fast[row, top] - exact[row, top]).abs().max() > 1e-3  # what it corrects is really there
        rest = torch.ones_like(got[row], dtype=torch.bool)
        rest[top] = False
        assert torch.equal(got[row, rest], fast[row, rest])
    assert float(dec.lm_head.fast.nbytes()) == dec.lm_head.nbytes()
    assert not isinstance(Decoder(cfg, kept, CPU, torch.float32, quant="auto").lm_head, ExactTopHead)


@pytest.mark.slow
def test_bad_quant_is_one_line_exit_2():
    assert_one_line_error(zoomr("solve", "-p", "hi", "-n", "2", "--quant", "int3"))
    for flag, value in (("--quant", "int4"), ("--kv-dtype", "bf16")):
        r = zoomr("solve", "-p", "hi", "-n", "2", flag, value, "--backend", "llamacpp")
        assert_one_line_error(r)
        assert "torch backend" in r.stderr


def test_int4_at_load_quantizes_float_body_and_gives_the_head_int8(gguf_weights):
    """HF-style float weights under --quant int4: the layers int4, the (tied) head int8 per row."""
    from zoomr.backends.torch.model import Decoder

    cfg, floats = gguf_weights
    dec = Decoder(cfg, floats, CPU, torch.bfloat16, quant="int4")
    assert dec.weight_summary() == "int4 (from float), head int8 (from float)"
    assert isinstance(dec.embed, torch.Tensor)  # the lookup table stays dense


def test_kv_dtype_auto_is_fp32_on_cpu_and_the_compute_dtype_on_cuda():
    """Half-precision attention is the slow part of a CPU decode step: auto keeps the KV cache in fp32 there."""
    from zoomr.backends.torch.engine import pick_kv_dtype

    assert pick_kv_dtype("auto", CPU, torch.bfloat16) is torch.float32
    assert pick_kv_dtype("auto", torch.device("cuda"), torch.bfloat16) is torch.bfloat16
    assert pick_kv_dtype("fp16", CPU, torch.bfloat16) is torch.float16
    with pytest.raises(ValueError, match="--kv-dtype 'int8' unknown"):
        pick_kv_dtype("int8", CPU, torch.float32)


@pytest.mark.parametrize("kv_dtype,expect", [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_kv_cache_holds_the_kv_dtype(kv_dtype, expect):
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

    be = TorchBackend(resolve_model(None), device="cpu", dtype="bf16", n_ctx=64, kv_dtype=kv_dtype)
    assert be.kv_dtype is expect and be.model.rope.cos.dtype is expect
    rkv = be.with_cache_factory(PolicyCacheFactory(PolicySpec("rkv", 16)))
    for backend in (be, rkv):
        seq = backend.new_sequence()
        logits = backend.prefill(seq, [1, 2, 3, 4])
        assert np.isfinite(logits).all()
        assert {t.dtype for _, t in seq.cache.storages()} == {expect}
        # 4 positions × K and V × 30 layers × 3 KV heads × 64 dims
        assert backend.kv_stats(seq).full_bytes == 4 * 2 * 30 * 3 * 64 * expect.itemsize
