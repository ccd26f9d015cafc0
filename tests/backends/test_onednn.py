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
