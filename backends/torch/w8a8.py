"""int8 weights × int8 activations on x86 CPUs: fbgemm's dynamic-quantized linear (``--quant w8a8``).

Each call quantizes its activations [T, K] to 8-bit codes and runs an integer GEMM against weights held as
signed 8-bit codes with one scale per output row (``torch.ops.quantized.linear_prepack`` /
``linear_dynamic``, fbgemm), accumulating in int32. Integer dot products are what llama.cpp's CPU path runs
(a Q4/Q8 weight block times a Q8 activation block: ``vpmaddubsw`` on AVX2, VNNI on AVX512); they are what
makes it fast where torch's int4 bf16 kernel is compute-bound, and they batch well: each weight byte
is read once for every row and multiplied at four times fp32's rate.

A lossy mode, chosen by name only (``--quant auto`` never picks it): it rounds in three places.

- Weights: the GGUF's values (exact ``code · scale + zero`` per block of 32) are re-quantized with one
  symmetric scale per output row, the only grouping fbgemm's dynamic op takes; a row's step is its largest
  |w| / 127, coarser than the file's per-32 steps.
- Activations: fbgemm takes one affine 8-bit map per call, from the call's min and max. Each row is divided
  by its largest |x| (and the output multiplied back), and two input columns with zero weights hold the
  fixed ends -128/127 and 1 (-64/63 and 1 for 7-bit codes): every call's range is then exactly that, its
  zero point an integer, -1, 0 and 1 codes. So every row of every call gets the same map: a batch-mate's
  outliers do not coarsen a row, and prefill, batched and one-row decode give each row the same codes,
  hence the same integer sums (batching changes no greedy text). Channels within a row share a step, set by
  the row's largest value (llama.cpp has one per 32 values).
- Without AVX512-VNNI the codes are 7-bit (``reduce_range``): AVX2's ``vpmaddubsw`` adds two u8·s8
  products in int16, which full 8-bit codes can overflow (255 · 127 · 2 > 32767); fbgemm's VNNI path
  accumulates in int32 and takes all 8 bits. Results therefore differ slightly between the two CPU kinds.

The head's top logits are recomputed exactly from the file's rows (:class:`~.head.ExactTopHead`).
What it costs against llama.cpp is measured by ``benchmarks/quant_fidelity.py`` (docs/backends.md).

Source: the kernel is fbgemm's (pytorch/FBGEMM, dynamic quantization through ``torch.ops.quantized``); the
comparison with ggml's dot products is from llama.cpp's ``ggml-cpu`` quants.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np
import torch


def available(device: torch.device) -> bool:
    """fbgemm's int8 dynamic linear runs here: a CPU device and an x86 torch build with fbgemm."""
    return (device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_dynamic"))


@functools.cache
def has_vnni() -> bool:
    """This CPU has AVX512-VNNI (Linux ``/proc/cpuinfo`` flag ``avx512_vnni``), where fbgemm multiplies full
    8-bit activation codes without int16 saturation. False where the flags cannot be read."""
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


class W8A8Linear:
    """A linear over fbgemm's packed int8 weights, activations quantized per call, each row on its own scale.

    Args:
        w: [N, K] float32 weight (GGUF blocks dequantized first: exact values, rounded per row here).
        b: [N] float32 bias or None.
        source: the GGUF type(s) the weight came from, ``/``-joined, for the model line (``Q4_1``, ``float``).
    Raises:
        ValueError: no fbgemm in this torch build (not an x86 CPU build).
    """

    def __init__(self, w: np.ndarray, b: np.ndarray | None, source: str = "float"):
        if not available(torch.device("cpu")):
            raise ValueError("--quant w8a8 runs fbgemm's int8 GEMM, which this torch build lacks (x86 CPUs "
                             "only): use --quant int4 or none")
        wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
        scale = wt.abs().amax(dim=1).double() / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        # two extra input columns with zero weights carry the activation range's ends (see __call__)
        padded = torch.cat([wt, torch.zeros(wt.shape[0], 2)], dim=1)
        with warnings.catch_warnings():
            # torch flags its quantized tensor type as deprecated; prepacking still takes one
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(padded, scale, torch.zeros(wt.shape[0], dtype=torch.long), 0,
                                            torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.b = None if b is None else torch.from_numpy(np.ascontiguousarray(b, np.float32))
        self.shape = tuple(wt.shape)
        self.reduce_range = not has_vnni()
        # codes 0..Q, zero point Z = (Q + 1) / 2: on [-Z / (Q - Z), 1] the step is 1 / (Q - Z) and -1, 0, 1 are
        # codes, so a row divided by its largest |x| keeps that value exactly
        q_max = 127 if self.reduce_range else 255
        zero = (q_max + 1) // 2
        self.pad = torch.tensor([-zero / (q_max - zero), 1.0])
        bits = 7 if self.reduce_range else 8
        self.kind = "/".join(f"w8a{bits} (from {src})" for src in source.split("/"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 → [T, N] float32; each row's result does not depend on the other rows."""
        m = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)  # max |x| per row
        # each row divided into [-1, 1], then the two fixed columns (zero weights) make every call's range
        # [low, 1] exactly: one activation map for every row of every call
        unit = torch.cat([x / m, self.pad.expand(x.shape[0], 2)], dim=-1)
        y = torch.ops.quantized.linear_dynamic(unit, self.packed, self.reduce_range) * m
        return y if self.b is None else y + self.b

    def nbytes(self) -> int:
        """int8 codes plus a scale per row (and the bias): what the packed matrix holds (bytes)."""
        N, K = self.shape
        return N * (K + 2) + 4 * N + (4 * N if self.b is not None else 0)
