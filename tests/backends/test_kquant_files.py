"""K-quant GGUF files, written by llama.cpp's own quantizer from the embedded model, in the torch backend: the
blocks kept quantized exactly as the file holds them, within the documented bytes, agreeing with llama.cpp.

SmolLM2-135M's hidden size 576 is not a multiple of the 256-weight super-block, so llama.cpp gives the
K-quant only to ffn_down (input 1536) and falls back elsewhere: the files mix types as real ones do."""

import numpy as np
import pytest
import torch

from conftest import assert_as_faithful_as_llamacpp, zoomr
from zoomr.backends.gguf_file import check_gguf
from zoomr.backends.torch.quant import GroupQuant

CPU = torch.device("cpu")
# llama.cpp file type → the types its file holds (counted by tensor), as llama.cpp b-series writes them here
FILE_TYPES = {
    "Q4_K_M": {"Q4_K": 16, "Q6_K": 14, "Q5_0": 166, "Q8_0": 15, "F32": 61},
    "Q5_K_M": {"Q5_K": 16, "Q6_K": 14, "Q5_1": 166, "Q8_0": 15, "F32": 61},
    "Q6_K": {"Q6_K": 30, "Q8_0": 181, "F32": 61},
}
# what each becomes under --quant auto (bf16), and the most bytes it may hold per byte of the file (ffn_down)
FORMS = {"Q4_K": ("int4 (Q4_K)", 1.12), "Q5_K": ("int4×2 (Q5_K)", 1.82), "Q6_K": ("int4×2 (Q6_K regrouped)", 1.53)}


@pytest.fixture(scope="session")
def kquant_files(tmp_path_factory, embedded_path) -> dict:
    """ftype → path of the embedded model re-quantized by llama.cpp (about 1.5 s each, once per session)."""
    from zoomr.backends.llamacpp.requantize import requantize

    out = tmp_path_factory.mktemp("kquant")
    return {ft: requantize(embedded_path, out / f"smollm2-{ft}.gguf", ft) for ft in FILE_TYPES}


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
@pytest.mark.slow
def test_kept_blocks_are_the_files_values(kquant_files, ftype):
    """Every tensor of a kept type comes back as codes and scales whose values are gguf's dequantization of the
    file (Q/K rows unpermuted alike): nothing but the F32 norms is read as floats."""
    from zoomr.backends.torch.weights import load_gguf

    path = kquant_files[ftype]
    types = {}
    for t in check_gguf(path).tensors:
        types[t.ggml_type.name] = types.get(t.ggml_type.name, 0) + 1
    assert types == FILE_TYPES[ftype]
    _, kept, _ = load_gguf(path, keep_blocks=True)
    _, floats, _ = load_gguf(path)
    sources = {}
    for name, w in kept.items():
        if isinstance(w, GroupQuant):
            sources[w.source] = sources.get(w.source, 0) + 1
            np.testing.assert_array_equal(w.dequantize(), floats[name], err_msg=name)
        else:
            assert w.ndim == 1, name  # the norms
    assert sources == {k: v for k, v in FILE_TYPES[ftype].items() if k != "F32"}


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
@pytest.mark.slow
def test_kquant_linears_stay_quantized_within_their_bytes(kquant_files, ftype):
    """--quant auto in bf16: the model line names each type's form; a K-quant ffn_down holds at most the
    documented multiple of its bytes in the file (Q4_K: 4-bit codes + a bf16 scale and zero per 32, 5 / 4.5)."""
    from zoomr.backends.torch.model import Decoder
    from zoomr.backends.torch.weights import load_gguf

    path = kquant_files[ftype]
    cfg, kept, _ = load_gguf(path, keep_blocks=True)
    dec = Decoder(cfg, kept, CPU, torch.bfloat16, quant="auto")
    summary = dec.weight_summary()
    assert "dense" not in summary and summary.endswith("head int4×2 (Q8_0), top-64 exact"), summary
    file_bytes = {t.name: t.n_bytes for t in check_gguf(path).tensors}
    by_type = {}
    for i, layer in enumerate(dec.layers):
        src = kept[f"model.layers.{i}.mlp.down_proj.weight"].source
        held, stored = by_type.get(src, (0, 0))
        by_type[src] = (held + layer.down.nbytes(), stored + file_bytes[f"blk.{i}.ffn_down.weight"])
    for src, (held, stored) in by_type.items():
        form, most = FORMS[src]
        assert form in summary.split(", ")[0].split("/")
        assert held <= most * stored, (src, held / stored)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", list(FILE_TYPES))
def test_kquant_files_match_llamacpp(kquant_files, ftype):
    """Teacher-forced over 512 tokens of GSM8K text, against llama.cpp on the same file: the blocks kept in the
    int4 kernel (bf16) agree with llama.cpp as well as the same weights dequantized to dense bf16 do (what
    ``--quant auto`` ran for K-quants before), within 0.0003 nats of KL. Measured on an AVX512-BF16 CPU, KL of
    fp32 / dense bf16 / int4: Q4_K_M 0.00359 / 0.00427 / 0.00402, Q5_K_M 0.00443 / 0.00490 / 0.00502,
    Q6_K 0.00398 / 0.00454 / 0.00437 nats."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.evaluation.parity import agreement, gsm8k_text_ids, llamacpp_logits

    path = kquant_files[ftype]
    src = resolve_model(str(path))
    result = {}
    logits = {}
    for dtype, quant in (("bf16", "none"), ("fp32", "ggml"), ("fp32", "exact"), ("bf16", "auto")):
        be = TorchBackend(src, device="cpu", dtype=dtype, quant="none" if quant == "exact" else quant, n_ctx=1024)
        if not result:
            ids = gsm8k_text_ids(be.tokenizer, 512)
            ref = llamacpp_logits(path, ids)
        logits[quant] = be.prefill(be.new_sequence(), ids, all_logits=True)
        result[quant] = agreement(logits[quant], ref)
        print(f"\n{ftype} {be.describe()}: top-1 {result[quant][0]:.4f}, KL {result[quant][1]:.5f}")
    assert "int4" in be.describe() and "dense" not in be.describe()
    top1, kl = result["auto"]
    assert top1 >= 0.95
    assert kl - result["none"][1] <= 0.0003
    # ggml runs the file's types as llama.cpp does, 8-bit activations included: one more draw of the same
    # rounding noise, so as faithful to the weights as llama.cpp (KL dense bf16 / ggml vs llama.cpp: AVX2 Q4_K_M
    # 0.00451 / 0.00452, Q6_K 0.00460 / 0.00425; AVX512 Q5_K_M 0.00490 / 0.00579)
    assert_as_faithful_as_llamacpp(logits["ggml"], ref, logits["exact"], f"{ftype} ggml")


@pytest.mark.slow
def test_model_line_says_what_the_kquants_became(kquant_files):
    # --dtype bf16: the int4 path (the default --quant auto may pick ggml here, which runs the types as they are)
    r = zoomr("solve", "-m", str(kquant_files["Q4_K_M"]), "-p", "2+2=", "-n", "2", "--backend", "torch",
              "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "weights int4 (Q4_K)/int4×2 (Q5_0)/int4×2 (Q6_K regrouped)/int4×2 (Q8_0), head int4×2 (Q8_0)" in out, out
    r = zoomr("solve", "-m", str(kquant_files["Q4_K_M"]), "-p", "2+2=", "-n", "2", "--quant", "ggml")
    assert r.returncode == 0, r.stderr
    # Q4_K goes into ggml's repacked layout where this CPU has one (x86 with AVX2), as llama.cpp loads it
    from zoomr.backends.torch.ggml_ops import PackedWeight
    from zoomr.backends.torch.weights import load_gguf

    down = next(w for w in load_gguf(kquant_files["Q4_K_M"], raw=True)[1].values()
                if getattr(w, "type_name", "") == "Q4_K")
    q4k = "Q4_K repacked" if PackedWeight.of(down.data, down.ggml_type, down.shape) else "Q4_K"
    assert f"weights ggml ({q4k})/ggml (Q5_0)/ggml (Q6_K)/ggml (Q8_0), head ggml (Q8_0)" in r.stdout + r.stderr
