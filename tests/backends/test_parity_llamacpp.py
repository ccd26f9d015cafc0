"""The torch decoder against llama.cpp on the same GGUF file, teacher-forced over real text."""

import numpy as np
import pytest

from zoomr.evaluation.datasets import records

N_TOKENS = 512


def real_text_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text: GSM8K questions and worked answers, in file order."""
    parts = []
    for rec in records("gsm8k"):  # the copy shipped in the package
        parts.append(f"Question: {rec['question']}\nAnswer: {rec['answer']}\n\n")
        ids = tokenizer.encode("".join(parts), add_bos=False, special=False)
        if len(ids) >= n:
            return ids[:n]
    raise AssertionError("GSM8K file too short")


def llamacpp_logits(path, ids: list[int]) -> np.ndarray:
    """[T, vocab] logits from llama.cpp itself (logits for every position)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=1024, logits_all=True, verbose=False, seed=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()  # now, not in __del__ at interpreter exit, when llama.cpp's bindings are already gone


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def agreement(backend, embedded_path) -> tuple[float, float]:
    """(top-1 agreement, mean KL(llama.cpp || torch) in nats) teacher-forced over N_TOKENS of real text."""
    ids = real_text_ids(backend.tokenizer, N_TOKENS)
    ours = backend.prefill(backend.new_sequence(), ids, all_logits=True)
    ref = llamacpp_logits(embedded_path, ids)
    assert ours.shape == ref.shape == (N_TOKENS, backend.cfg.vocab)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    lp_ref, lp_ours = log_softmax(ref), log_softmax(ours)
    kl = float((np.exp(lp_ref) * (lp_ref - lp_ours)).sum(-1).mean())
    print(f"\n{backend.describe()}: over {N_TOKENS} tokens top-1 agreement {top1:.4f}, mean KL(llama.cpp||torch) "
          f"{kl:.5f} nats, max |dlogit| {float(np.abs(ours - ref).max()):.3f}")
    return top1, kl


@pytest.mark.slow
def test_torch_matches_llamacpp_teacher_forced(torch_backend, embedded_path):
    top1, kl = agreement(torch_backend, embedded_path)  # fp32: measured 0.9824 / 0.00286
    assert top1 >= 0.95
    assert kl < 0.05


@pytest.mark.slow
def test_quantized_bf16_path_matches_llamacpp(embedded_path):
    """The default CPU path: the file's Q4_1/Q8_0 blocks kept as int4, bf16 activations, fp32 residual stream
    and fp32 KV. Measured 0.9746 / 0.00359 (bf16 KV: 0.9766 / 0.00386), as close as dense bf16 weights get
    (0.9746 / 0.00346): what bf16 activations and logits cost. The same int4 weights with fp32 activations give the fp32 path's numbers exactly
    (0.9824 / 0.00286; test_quant.py checks that decoder against the dense one)."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend

    be = TorchBackend(resolve_model(None), device="cpu", dtype="bf16", quant="auto", n_ctx=2048)
    assert "int4 (Q4_1)" in be.describe()
    top1, kl = agreement(be, embedded_path)
    assert top1 >= 0.97
    assert kl <= 0.0045


@pytest.mark.slow
def test_fp16_weights_path_meets_the_fidelity_target(embedded_path):
    """``--quant fp16``: fp16 weights, fp32 activations (fbgemm, x86). Measured 0.9824 / 0.00286, the fp32 path's
    agreement: the issue's target (top-1 >= 0.98, KL <= 0.003) met at the int4 path's decode speed."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.backends.torch.quant import fp16_gemm_available

    if not fp16_gemm_available(torch_cpu()):
        pytest.skip("fbgemm's fp16 GEMM is x86-only")
    be = TorchBackend(resolve_model(None), device="cpu", quant="fp16", n_ctx=2048)
    top1, kl = agreement(be, embedded_path)
    assert top1 >= 0.98
    assert kl <= 0.003


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_prefill_then_decode_equals_one_prefill(torch_backend):
    """KV-cache correctness: logits of token t are the same whether t came in the prefill or by decode."""
    ids = real_text_ids(torch_backend.tokenizer, 40)
    full = torch_backend.prefill(torch_backend.new_sequence(), ids, all_logits=True)
    seq = torch_backend.new_sequence()
    torch_backend.prefill(seq, ids[:30])
    stepped = [torch_backend.decode(seq, t) for t in ids[30:]]
    np.testing.assert_allclose(np.stack(stepped), full[30:], atol=2e-4, rtol=1e-4)


def test_fork_continues_independently(torch_backend):
    ids = real_text_ids(torch_backend.tokenizer, 20)
    seq = torch_backend.new_sequence()
    torch_backend.prefill(seq, ids[:10])
    child = torch_backend.fork(seq)
    a = torch_backend.decode(child, ids[10])
    torch_backend.decode(seq, ids[11])  # the parent moves on differently
    b = torch_backend.decode(torch_backend.fork(child), ids[12])
    ref = torch_backend.prefill(torch_backend.new_sequence(), ids[:11] + [ids[12]], all_logits=True)
    np.testing.assert_allclose(a, ref[-2], atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(b, ref[-1], atol=2e-4, rtol=1e-4)
