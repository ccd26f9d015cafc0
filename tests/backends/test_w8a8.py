"""``--quant w8a8``: int8 weights × int8 activations through fbgemm, each row quantized on its own range."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_one_line_error, zoomr
from zoomr.backends.torch.quant import check_quant, make_linear
from zoomr.backends.torch.w8a8 import W8A8Linear, available

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not available(CPU), reason="fbgemm's int8 GEMM is x86-only")


def per_row_int8(w: np.ndarray) -> torch.Tensor:
    """The weight as the mode holds it: symmetric int8 codes, one scale per output row, as float64."""
    wt = torch.from_numpy(w).double()
    s = wt.abs().amax(1, keepdim=True) / 127
    return (wt / s).round().clamp(-127, 127) * s


def test_w8a8_is_the_per_row_int8_weight_times_8bit_activations():
    """Within an activation step of the matmul on the per-row rounded weight, bias added in fp32."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    lin = W8A8Linear(w, b, source="Q4_1")
    x = torch.from_numpy(rng.standard_normal((5, 96)).astype(np.float32))
    want = F.linear(x.double(), per_row_int8(w), torch.from_numpy(b).double())
    got = lin(x).double()
    # 7- or 8-bit codes over [-max|x|, max|x|] per row: error per product ≤ step/2 · |w|
    step = 2 * x.abs().amax(1, keepdim=True).double() / 127
    bound = step / 2 * per_row_int8(w).abs().sum(1)[None, :] + 1e-4
    assert (got - want).abs().le(bound).all()
    assert (got - want).abs().max() > 0  # the activations are rounded: not a float path in disguise
    assert lin.kind in ("w8a8 (from Q4_1)", "w8a7 (from Q4_1)") and lin.nbytes() == 40 * 98 + 8 * 40


def test_a_row_gets_the_same_result_alone_and_in_any_batch():
    """Each row is scaled into one fixed range before the kernel, so fbgemm's one map per call is the same for every
    row: a batch-mate 1000× larger, or a constant row, changes no bit of a row's output (the integer sums are
    exact). Without the mapping the op quantizes the batch on its joint range and the rows move."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    lin = W8A8Linear(w, rng.standard_normal(48).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((5, 64)).astype(np.float32))
    x[1] *= 1000
    x[3] = 0.5  # constant: no range of its own
    together = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(5)])
    assert torch.equal(together, alone)
    exact = F.linear(x.double(), per_row_int8(w), lin.b.double())
    np.testing.assert_allclose(together[3].double().numpy(), exact[3].numpy(), rtol=1e-5, atol=1e-4)
    padded = torch.cat([x, torch.zeros(5, 2)], dim=-1)  # the held weight's two extra columns are zero
    joint = torch.ops.quantized.linear_dynamic(padded, lin.packed, lin.reduce_range)[0]  # the op alone, batched
    assert (joint.double() - exact[0] + lin.b.double()[None]).abs().max() > 10 * (together[0].double() - exact[0]).abs().max()


@pytest.mark.slow
def test_w8a8_mode_builds_and_computes_in_fp32_only(embedded_path):
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend, pick_dtype

    assert check_quant("w8a8") == "w8a8"
    assert isinstance(make_linear([np.ones((16, 32), np.float32)], None, "w8a8", CPU, torch.float32), W8A8Linear)
    assert pick_dtype("auto", CPU, "w8a8") == torch.float32
    with pytest.raises(ValueError, match="--quant w8a8 computes in fp32"):
        pick_dtype("bf16", CPU, "w8a8")
    be = TorchBackend(resolve_model(None), device="cpu", quant="w8a8", n_ctx=128)
    assert be.dtype == torch.float32 and "w8a" in be.model.weight_summary()
    assert "top-64 exact" in be.model.weight_summary()  # the head's leading logits recomputed from the file
    dense = TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=128)
    ids = be.tokenizer.encode("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning "
                              "and bakes muffins for her friends every day with four.", special=False)
    a = be.prefill(be.new_sequence(), ids, all_logits=True)
    d = dense.prefill(dense.new_sequence(), ids, all_logits=True)
    assert (a.argmax(-1) == d.argmax(-1)).mean() >= 0.7  # lossy (27 of 32 on an AVX512 CPU), yet the same model


def test_w8a8_with_a_half_dtype_is_one_line_exit_2():
    r = zoomr("solve", "-p", "hi", "-n", "2", "--quant", "w8a8", "--dtype", "bf16")
    assert_one_line_error(r)
    assert "--quant w8a8 computes in fp32" in r.stderr
