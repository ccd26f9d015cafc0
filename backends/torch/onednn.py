"""fp32 linears on a CPU through oneDNN with the weight packed once at load, instead of ``F.linear``.

``F.linear`` in fp32 on a CPU calls the BLAS torch was built with (MKL on x86 wheels). On an AMD EPYC
(AVX512) that GEMM's time grew several-fold from one row to two or eight, so decoding a batch of sequences
in one forward bought little; oneDNN's inner product on a weight reordered once for its own blocked layout
grew far less with the rows and was not slower at one row or at prefill sizes (measurements: docs/backends.md
"fp32 linears on a CPU").

The two ops used are the ones ``torch.compile`` itself emits for frozen CPU linears
(``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise``); they are not a documented public API,
so :func:`available` first checks them once against ``F.linear``; where they are missing or disagree,
:func:`pack` returns None and the caller keeps ``F.linear``. ``ZOOMR_ONEDNN=0`` in the environment turns the path off
(for a side-by-side measurement, or a build where it misbehaves).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

# the row count the packed layout is tuned for: a decode batch; it serves any row count
BATCH_HINT = 8


@functools.cache
def available() -> bool:
    """Whether this torch build packs and runs fp32 linears through oneDNN, checked on a small case against
    ``F.linear`` (to 1e-4 relative), and not turned off by ``ZOOMR_ONEDNN=0``."""
    if os.environ.get("ZOOMR_ONEDNN", "1") == "0":
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
        x = torch.randn(5, 64, generator=g)
        with torch.inference_mode():
            got, want = PackedWeight(w)(x, b), F.linear(x, w, b)
        return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())))
    except (AttributeError, RuntimeError, NotImplementedError):
        # the probe's answer, not a gap: a build without the ops (AttributeError) or whose oneDNN refuses
        # them on this CPU (RuntimeError / NotImplementedError) keeps F.linear
        return False


class PackedWeight:
    """A float32 CPU weight [N, K] reordered once for oneDNN's inner product (:func:`pack`).

    One property kept on purpose: a row's output does not depend on how many rows share the call, so a
    sequence decoded inside a batch gets bit for bit the logits it gets alone (``zoomr bench -np N`` and
    rescue's batched candidates then match their one-by-one runs). oneDNN meets that for any row count ≥ 2
    but, for some shapes (the embedded model's K = 1536 down projection), takes another kernel for a single
    row; such a weight gets its single rows as two identical rows. Which shapes do is checked at packing.

    Attributes:
        w: the packed tensor (N·K float32 values plus the layout's padding, in oneDNN's blocked layout).
    Source: oneDNN's inner product as torch exposes it for ``torch.compile``'s frozen CPU linears.
    """

    def __init__(self, w: torch.Tensor):
        with torch.inference_mode():
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT)
            x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0))
            self._pad_single = not torch.equal(self._run(x[:1], None), self._run(x, None)[:1])

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.w, bias, "none", [], "")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ wᵀ + bias`` for x [T, K] float32 (T ≥ 0), bias [N] or None: [T, N] float32."""
        if self._pad_single and x.shape[0] == 1:
            return self._run(x.expand(2, -1), bias)[:1]
        return self._run(x, bias)

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def pack(w: torch.Tensor) -> PackedWeight | None:
    """``w`` [N, K] (float32, CPU) packed for oneDNN, or None where it cannot take it (another dtype or
    device, or :func:`available` false); ``w`` itself is not changed. Raises nothing of its own: where the
    ops are unusable, :func:`available` already said so."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or not available():
        return None
    return PackedWeight(w)
