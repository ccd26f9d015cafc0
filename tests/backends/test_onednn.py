"""fp32 dense linears through oneDNN's packed inner product (backends/torch/onednn.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zoomr.backends.torch import onednn
from zoomr.backends.torch.quant import DenseLinear

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN fp32 linear")


# the embedded model's shapes: fused qkv, o, gate/up, down (K = 1536 is the shape whose single row takes
# another oneDNN kernel), and a small-vocabulary head
@needs_onednn
@pytest.mark.parametrize("n,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)])
def test_a_row_gets_the_same_bits_alone_as_in_a_batch(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    lin = DenseLinear(w.numpy(), b.numpy(), CPU, torch.float32)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(16)])
    for rows in (2, 3, 8, 16):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    want = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(alone.double(), want, rtol=0, atol=1e-4)


@needs_onednn
def test_packed_weight_replaces_the_plain_one_except_a_shared_table():
    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    own = DenseLinear(w, None, CPU, torch.float32)
    assert own.w is None and own.nbytes() >= w.nbytes and own.kind == "dense float32 (oneDNN)"
    table = torch.from_numpy(w)
    head = DenseLinear.sharing(table)
    assert head.w is table and head.nbytes() >= 2 * w.nbytes   # the table and its packed copy
    assert DenseLinear(w, None, CPU, torch.bfloat16)._packed is None   # only fp32 is packed


def test_zoomr_onednn_0_keeps_f_linear(monkeypatch):
    monkeypatch.setenv("ZOOMR_ONEDNN", "0")
    onednn.available.cache_clear()
    try:
        w = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
        lin = DenseLinear(w, None, CPU, torch.float32)
        assert lin._packed is None and lin.w is not None and lin.kind == "dense float32"
        x = torch.randn(3, 64)
        assert torch.equal(lin(x), F.linear(x, torch.from_numpy(w)))
    finally:
        onednn.available.cache_clear()


@needs_onednn
def test_a_sequence_decoded_in_a_batch_gets_the_bits_it_gets_alone(torch_backend):
    """fp32, full KV: the batch's logits equal one-by-one decoding exactly (F.linear's MKL GEMM differed by
    up to 3e-5 here, within test_batch's 1e-4 but not equal)."""
    be = torch_backend
    prompts = [be.tokenizer.encode(t) for t in ["The capital of France is", "Tom has 3 apples. He buys 5 more."]]
    alone = []
    for p in prompts:
        seq = be.new_sequence()
        rows = [be.prefill(seq, p)]
        for _ in range(4):
            rows.append(be.decode(seq, int(np.argmax(rows[-1]))))
        alone.append(rows)
        be.free(seq)
    seqs = [be.new_sequence() for _ in prompts]
    batch = [[np.asarray(be.prefill(s, p)) for s, p in zip(seqs, prompts)]]
    for _ in range(4):
        batch.append(list(np.asarray(be.decode_batch(seqs, [int(np.argmax(r)) for r in batch[-1]]))))
    for step in range(5):
        for b in range(2):
            assert np.array_equal(batch[step][b], alone[b][step]), (step, b)
    for s in seqs:
        be.free(s)
