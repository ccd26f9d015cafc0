"""Weight-only quantized linears for the torch decoder: weights stay 4- or 8-bit, activations in the compute dtype.

A quantized weight is held as integer codes with a group-wise affine map, ``w = code · scale + zero``
(:class:`GroupQuant`), which is exactly how GGUF's Q4_0, Q4_1 and Q8_0 blocks define their values (ggml's
``dequantize_row_q4_0`` / ``_q4_1`` / ``_q8_0``: 32 weights per block, an fp16 scale ``d`` and, for Q4_1, an
fp16 minimum ``m``). The blocks are read from the file's raw bytes (:func:`from_gguf_blocks`), never through
a float copy, and turned into torch's packed-weight kernels:

- :class:`Int4Linear`: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) / ``_weight_int4pack_mm`` (CUDA),
  unsigned 4-bit codes, groups of 32 along the input, ``w = (code − 8) · scale + zero`` with scale and zero in
  the activation dtype. Q4_1 maps as scale ``d``, zero ``m + 8d``; Q4_0 as scale ``d``, zero 0. Q8_0's signed
  8-bit codes split exactly into two 4-bit planes, ``q = 16·hi + lo`` (hi ∈ [−8, 7], lo ∈ [0, 15]), run as one
  kernel call over the input written twice (``[x, x]``): plane hi with scale 16d, zero 0; plane lo with scale
  d, zero 8d. Same bytes as int8, same values as the file.
- :class:`Int8Linear`: ``torch.ops.aten._weight_int8pack_mm``: signed 8-bit codes, one scale per output row
  (the kernel has no groups), so GGUF blocks are re-quantized per row (lossy; ``--quant int8`` only).
- :class:`Fp16Linear`: fbgemm's packed fp16 GEMM (``--quant fp16``, x86 CPUs): fp16 weights, fp32 activations
  and accumulation. Not a 4/8-bit format (twice int4's bytes), but on an AVX2 CPU it decoded as fast as the
  int4 kernel in bf16, prefilled ~2× faster, kept the fp32 path's agreement with llama.cpp, and its cost grows
  least with the batch (``benchmarks/backend_speed.py`` row ``fp16w``, ``batch_throughput.py --quant fp16``).
- :class:`DenseLinear`: ``F.linear`` on a compute-dtype weight (``--quant none``, and file types the kernels
  cannot hold, such as F16 or Q6_K); in fp32 on a CPU, oneDNN on a packed copy (:mod:`.onednn`).

Exactness: the codes are exact; the kernels take scale and zero in the activation dtype, so in bf16 each is
rounded to 8 significant bits (relative error ≤ 2⁻⁹, as a bf16 weight would be), and they return their output
in it (bf16: the same rounding of every output); in fp32 they are exact but an order of magnitude slower.
Where that output rounding costs agreement with llama.cpp the decoder works around it: :mod:`.head` for the
logits, an fp32 SwiGLU product in :mod:`.model`.

Kernel choice: the int4 bf16 kernel is the fastest of these per decode token on both CPUs measured (AVX2 and
AVX512-BF16; ``benchmarks/backend_speed.py`` rows, README "Quantized weights"), and the int kernels in fp32 or
fp16 are an order of magnitude slower than in bf16. torchao 0.18's int4 CPU layout calls the same aten op, its
int8 weight-only layout was slower than ``_weight_int8pack_mm``, and its PyPI wheel carries no CPU kernels of
its own (the AVX512 ``da8w4`` op is absent).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import onednn

GROUP = 32  # GGUF's block of Q4_0/Q4_1/Q8_0; also the group the int4 kernel runs at load-time quantization
QUANT_MODES = ("auto", "none", "int8", "int4", "fp16")
# ggml type names whose blocks map onto :class:`GroupQuant` exactly
GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# the CPU int4 kernel packs output rows in tiles of 16
_CPU_N_ALIGN = 16


def check_quant(spec: str) -> str:
    """``spec`` itself when it is a ``--quant`` mode.

    Raises:
        ValueError: an unknown mode (the message names the choices).
    """
    if spec not in QUANT_MODES:
        raise ValueError(f"--quant {spec!r} unknown (choose from {', '.join(QUANT_MODES)})")
    return spec


@dataclass
class GroupQuant:
    """A weight as integer codes with a per-group affine map: ``w[n, k] = codes[n, k] · scale[n, g] + zero[n, g]``
    with ``g = k // group``.

    Attributes:
        codes: [N, K] int16 (Q8_0: −128..127; 4-bit types: 0..15).
        scale, zero: [N, K // group] float32 (the file's fp16 values, widened exactly).
        group: weights per group along K.
        bits: 4 or 8, the codes' width.
        source: where the values came from (``Q4_1``, ``from float`` ...), for descriptions.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    group: int
    bits: int
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> np.ndarray:
        """The weight as float32 [N, K], computed as ggml does (fp32 ``code · d + m``)."""
        N, K = self.codes.shape
        c = self.codes.astype(np.float32).reshape(N, K // self.group, self.group)
        return (c * self.scale[..., None] + self.zero[..., None]).reshape(N, K)

    def take_rows(self, order: np.ndarray) -> "GroupQuant":
        """The same weight with rows reordered (``order``: [N] row indices)."""
        return GroupQuant(self.codes[order], self.scale[order], self.zero[order], self.group, self.bits, self.source)

    @staticmethod
    def concat(parts: list["GroupQuant"]) -> "GroupQuant":
        """Rows of ``parts`` stacked (same K, group and bits).

        Raises:
            ValueError: parts that differ in K, group or bits.
        """
        first = parts[0]
        if any(p.group != first.group or p.bits != first.bits or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("cannot stack quantized weights of different layouts")
        src = "/".join(sorted({p.source for p in parts}))
        return GroupQuant(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                          np.concatenate([p.zero for p in parts]), first.group, first.bits, src)


def from_gguf_blocks(raw: np.ndarray, type_name: str) -> GroupQuant:
    """Decode GGUF blocks into codes, scales and zeros without rounding anything.

    Block layouts (ggml ``block_q4_0``, ``block_q4_1``, ``block_q8_0``; 32 weights each, little-endian):
    Q4_0 = fp16 d, 16 bytes of nibbles (weight j in the low nibble of byte j, weight j+16 in the high one),
    ``w = d·(q − 8)``; Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles, ``w = d·q + m``; Q8_0 = fp16 d, 32 int8,
    ``w = d·q``.

    Args:
        raw: [N, blocks · bytes_per_block] uint8, one row of the tensor per row.
        type_name: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
    Returns:
        [N, 32 · blocks] :class:`GroupQuant` with group 32.
    Raises:
        ValueError: another type, or a row length that is not a whole number of blocks.
    """
    sizes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
    if type_name not in sizes:
        raise ValueError(f"no exact int mapping for GGUF type {type_name}")
    N, row_bytes = raw.shape
    size = sizes[type_name]
    if row_bytes % size:
        raise ValueError(f"{type_name} row of {row_bytes} bytes is not a whole number of {size}-byte blocks")
    nb = row_bytes // size
    blocks = np.ascontiguousarray(raw).reshape(N, nb, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
        zero = np.zeros_like(d)
        bits = 8
    else:
        start = 4 if type_name == "Q4_1" else 2
        packed = blocks[..., start:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)
        if type_name == "Q4_1":
            zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:  # d·(q − 8) = d·q + (−8d): exact in fp32 (a power-of-two multiple of an fp16 value)
            zero = -8.0 * d
        bits = 4
    return GroupQuant(codes.reshape(N, nb * GROUP), d, zero, GROUP, bits, type_name)


def quantize_int4(w: np.ndarray, group: int = GROUP) -> GroupQuant:
    """Group-wise asymmetric 4-bit quantization of a float weight (round to nearest, min/max range).

    Args:
        w: [N, K] float weight, K divisible by ``group``.
    Returns:
        codes 0..15 with ``scale = (max − min) / 15`` and ``zero = min`` per group (a constant group gets scale 1
        and is exact).
    Raises:
        ValueError: K not divisible by ``group``.
    """
    N, K = w.shape
    if K % group:
        raise ValueError(f"input size {K} is not a multiple of the int4 group {group}")
    g = w.astype(np.float32).reshape(N, K // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scale = (hi - lo) / 15.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.int16)
    return GroupQuant(codes.reshape(N, K), scale, lo.astype(np.float32), group, 4, "from float")


def _padded_rows(n: int, align: int) -> int:
    return -(-n // align) * align


class DenseLinear:
    """A linear on a weight held in the compute dtype: ``F.linear``, or in fp32 on a CPU oneDNN's inner
    product on a weight packed once (:mod:`.onednn`; its GEMM grows far less with the row count than the
    BLAS one on the CPUs measured, which is what batched decoding needs).

    Args:
        w: [N, K] float weight (any numpy float dtype); b: [N] bias or None.
        device, dtype: where and in which dtype to hold them.
    """

    def __init__(self, w: np.ndarray, b: np.ndarray | None, device: torch.device, dtype: torch.dtype):
        self._setup(torch.from_numpy(np.ascontiguousarray(w)).to(device=device, dtype=dtype),
                    None if b is None else torch.from_numpy(np.ascontiguousarray(b)).to(device, dtype), shared=False)

    @classmethod
    def sharing(cls, w: torch.Tensor) -> "DenseLinear":
        """A bias-free linear over the tensor ``w`` [N, K] itself (a tied LM head shares the embedding table;
        where the fp32 weight is packed for oneDNN, the packed copy is held besides it)."""
        self = cls.__new__(cls)
        self._setup(w, None, shared=True)
        return self

    def _setup(self, w: torch.Tensor, b: torch.Tensor | None, shared: bool) -> None:
        self.w, self.b = w, b
        # CPUs without bf16/fp16 arithmetic run those GEMMs several times slower than fp32, while a one-row
        # decode GEMV is memory-bound and gains from the half-size weight: upcast only many-row (prefill) GEMMs
        self._upcast = w.device.type == "cpu" and w.dtype != torch.float32
        self._packed = onednn.pack(w)
        if self._packed is not None and not shared:
            self.w = None   # every call reads the packed copy: the plain one is not kept
        self.kind = f"dense {str(w.dtype).replace('torch.', '')}{' (oneDNN)' if self._packed is not None else ''}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, N] in the compute dtype."""
        if self._packed is not None:
            return self._packed(x, self.b)
        if self._upcast and x.shape[0] > 8:
            return F.linear(x.float(), self.w.float(), None if self.b is None else self.b.float()).to(x.dtype)
        return F.linear(x, self.w, self.b)

    def nbytes(self) -> int:
        held = [t.numel() * t.element_size() for t in (self.w, self.b) if t is not None]
        return sum(held) + (self._packed.nbytes() if self._packed is not None else 0)


class Int4Linear:
    """4-bit weight-only linear over torch's packed int4 kernel, groups of 32 along the input.

    A :class:`GroupQuant` with 4-bit codes packs as is (scale → scale, zero → zero + 8·scale); one with 8-bit
    codes (Q8_0) packs as two 4-bit planes over the input written twice, which keeps its values exactly.

    Args:
        q: [N, K] quantized weight (group 32).
        b: [N] float32 bias or None.
        device: CPU or CUDA; dtype: the activation dtype (scales are held in it; CUDA needs bf16).
    Raises:
        ValueError: a group other than 32, or a CUDA dtype other than bf16.
    """

    def __init__(self, q: GroupQuant, b: np.ndarray | None, device: torch.device, dtype: torch.dtype):
        if q.group != GROUP:
            raise ValueError(f"int4 kernel runs groups of {GROUP}, not {q.group}")
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError("the CUDA int4 kernel needs --dtype bf16")
        N, K = q.shape
        if q.bits == 8:
            codes8 = q.codes.astype(np.int16)
            hi, lo = codes8 >> 4, codes8 & 0x0F  # arithmetic shift: q = 16·hi + lo, hi ∈ [−8, 7], lo ∈ [0, 15]
            codes = np.concatenate([hi + 8, lo], axis=1)
            scale = np.concatenate([16.0 * q.scale, q.scale], axis=1)
            zero = np.concatenate([q.zero, q.zero + 8.0 * q.scale], axis=1)
            self.repeat = 2
        else:
            codes, scale, zero = q.codes, q.scale, q.zero + 8.0 * q.scale
            self.repeat = 1
        self.n_out = N
        n_pad = _padded_rows(N, _CPU_N_ALIGN)
        if n_pad != N:  # padded rows are zero codes with zero scale and zero: their outputs are dropped
            pad = n_pad - N
            codes = np.concatenate([codes, np.zeros((pad, codes.shape[1]), codes.dtype)])
            scale = np.concatenate([scale, np.zeros((pad, scale.shape[1]), np.float32)])
            zero = np.concatenate([zero, np.zeros((pad, zero.shape[1]), np.float32)])
        codes_t = torch.from_numpy(np.ascontiguousarray(codes, np.int32))
        # the kernels' layout: [K // group, N, 2] holding (scale, zero) per group and output row
        sz = torch.from_numpy(np.ascontiguousarray(np.stack([scale.T, zero.T], axis=-1), np.float32))
        self.k_in = codes.shape[1]
        if device.type == "cuda":
            nibbles = (codes_t[:, ::2] << 4 | codes_t[:, 1::2]).to(torch.uint8).to(device)
            tiles = next(t for t in (8, 4, 2) if self.k_in % (t * 16) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)
            self._mm = torch.ops.aten._weight_int4pack_mm
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes_t, 1)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        self.scale_zero = sz.to(device=device, dtype=dtype)
        self.b = None if b is None else torch.from_numpy(np.ascontiguousarray(b, np.float32)).to(device, dtype)
        self.kind = f"int4 ({q.source})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, N] in x's dtype (which must be the dtype the scales were built in)."""
        if self.repeat == 2:
            x = torch.cat([x, x], dim=-1)
        y = self._mm(x, self.packed, GROUP, self.scale_zero)
        if y.shape[-1] != self.n_out:
            y = y[..., :self.n_out]
        return y if self.b is None else y + self.b

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero, self.b) if t is not None)


class Int8Linear:
    """8-bit weight-only linear over ``torch.ops.aten._weight_int8pack_mm``: symmetric per-output-row scales.

    Args:
        w: [N, K] float32 weight (a GGUF block weight is dequantized first: the kernel has no groups).
        b: [N] bias or None; device, dtype as for :class:`Int4Linear`.
    """

    def __init__(self, w: np.ndarray, b: np.ndarray | None, device: torch.device, dtype: torch.dtype,
                 source: str = "fp32"):
        wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
        scale = wt.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.w8 = (wt / scale[:, None]).round().clamp(-127, 127).to(torch.int8).to(device)
        self.scale = scale.to(device=device, dtype=dtype)
        self.b = None if b is None else torch.from_numpy(np.ascontiguousarray(b, np.float32)).to(device, dtype)
        self.kind = f"int8 (from {source})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, N] in x's dtype."""
        y = torch.ops.aten._weight_int8pack_mm(x, self.w8, self.scale)
        return y if self.b is None else y + self.b

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w8, self.scale, self.b) if t is not None)


def fp16_gemm_available(device: torch.device) -> bool:
    """fbgemm's packed fp16 GEMM runs here: a CPU device and a torch build with fbgemm (x86)."""
    return (device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_prepack_fp16"))


class Fp16Linear:
    """fp16 weights, fp32 activations and accumulation: fbgemm's packed fp16 GEMM
    (``torch.ops.quantized.linear_prepack_fp16`` / ``linear_dynamic_fp16``; x86 CPUs).

    Half the bytes of fp32 weights, read and widened inside the kernel, so the results are those of fp32
    weights rounded to fp16 (11 significant bits; a GGUF Q4/Q8 weight rounds by at most 2⁻¹¹ of itself),
    with fp32 activations: nothing else is rounded. No activation is quantized, so a row of a batch gets
    what it gets alone, up to fp32 summation order.

    Args:
        w: [N, K] float32 weight (GGUF blocks dequantized first); b: [N] bias or None.
    Raises:
        ValueError: no fbgemm here (not an x86 CPU build).
    """

    def __init__(self, w: np.ndarray, b: np.ndarray | None):
        if not fp16_gemm_available(torch.device("cpu")):
            raise ValueError("--quant fp16 runs fbgemm's fp16 GEMM, which this torch build lacks (x86 CPUs "
                             "only): use --quant int4 or none")
        wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
        bt = None if b is None else torch.from_numpy(np.ascontiguousarray(b, np.float32))
        self.packed = torch.ops.quantized.linear_prepack_fp16(wt, bt)
        self.shape = tuple(wt.shape)
        self.has_bias = b is not None
        self.kind = "fp16 (fbgemm)"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 → [T, N] float32."""
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def nbytes(self) -> int:
        N, K = self.shape
        return 2 * N * K + (4 * N if self.has_bias else 0)


Linear = DenseLinear | Int4Linear | Int8Linear | Fp16Linear
Weight = np.ndarray | GroupQuant


def make_linear(parts: list[Weight], bias: np.ndarray | None, mode: str, device: torch.device,
                dtype: torch.dtype) -> Linear:
    """One linear from the row blocks ``parts`` (fused QKV, gate/up) under ``--quant`` ``mode``.

    ``auto`` keeps GGUF blocks as int4 (exact) and float weights dense; ``int4`` also quantizes float weights
    (group 32, asymmetric) and re-quantizes block types whose codes do not fit (none: every supported block
    type fits, Q8_0 as two planes); ``int8`` re-quantizes everything per row; ``fp16`` holds every weight in
    fp16 for fbgemm's fp32-compute GEMM (:class:`Fp16Linear`, CPU); ``none`` is dense.

    Args:
        parts: [N_i, K] float32 arrays or :class:`GroupQuant` (same K), stacked in order.
        bias: [ΣN_i] float32 or None.
        mode: resolved ``--quant`` (auto, none, int8, int4, fp16).
    Raises:
        ValueError: ``fp16`` where fbgemm is missing.
    """
    all_blocks = all(isinstance(p, GroupQuant) for p in parts)
    if mode == "none" or (mode == "auto" and not all_blocks):
        return DenseLinear(_stack_dense(parts), bias, device, dtype)
    if mode == "fp16":
        return Fp16Linear(_stack_dense(parts), bias)
    if mode == "int8":
        src = "/".join(sorted({p.source if isinstance(p, GroupQuant) else "float" for p in parts}))
        return Int8Linear(_stack_dense(parts), bias, device, dtype, source=src)
    K = parts[0].shape[1]
    if K % GROUP:  # no group fits: the kernel cannot hold it
        return DenseLinear(_stack_dense(parts), bias, device, dtype)
    q = GroupQuant.concat([p if isinstance(p, GroupQuant) else quantize_int4(p) for p in parts])
    return Int4Linear(q, bias, device, dtype)


def _stack_dense(parts: list[Weight]) -> np.ndarray:
    return np.concatenate([p.dequantize() if isinstance(p, GroupQuant) else p for p in parts])


class QuantEmbedding:
    """Token embedding rows dequantized on lookup from the file's blocks (exact: fp32 ``code · scale + zero``).

    Args:
        q: [V, hidden] quantized table; device: where the rows are computed.
    """

    def __init__(self, q: GroupQuant, device: torch.device):
        self.codes = torch.from_numpy(q.codes.astype(np.int8 if q.bits == 8 else np.uint8)).to(device)
        self.scale = torch.from_numpy(q.scale).to(device)
        self.zero = torch.from_numpy(q.zero).to(device)
        self.group = q.group

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 → [T, hidden] float32 (the decoder's residual stream)."""
        c = self.codes[ids].float()
        T, K = c.shape
        rows = c.view(T, K // self.group, self.group) * self.scale[ids][..., None] + self.zero[ids][..., None]
        return rows.view(T, K)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))
