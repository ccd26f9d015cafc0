"""Weight-only quantized linears for the torch decoder: weights stay 4- or 8-bit, activations in the compute dtype.

A quantized weight is held as integer codes with a group-wise affine map, ``w = code · scale + zero``
(:class:`GroupQuant`), which is exactly how GGUF's block types define their values (ggml's
``dequantize_row_*``): the legacy Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 weights per block, fp16 ``d`` and, for
_1, an fp16 minimum ``m``) and the K-quants Q4_K, Q5_K (super-blocks of 256 in 8 sub-blocks of 32, each
scale ``d·sc`` and minimum ``dmin·m``) and Q6_K (16 sub-blocks of 16, scale ``d·sc``, zero 0). The blocks are
read from the file's raw bytes (:func:`from_gguf_blocks`), never through a float copy, and turned into
torch's packed-weight kernels:

- :class:`Int4Linear`: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) / ``_weight_int4pack_mm`` (CUDA),
  unsigned 4-bit codes, groups of 32 along the input, ``w = (code − 8) · scale + zero`` with scale and zero in
  the activation dtype. What each GGUF type becomes (:func:`kernel_planes`):

  - Q4_0, Q4_1, Q4_K: one plane, the file's codes and per-32 affine map (Q4_K: scale ``d·sc``, zero
    ``8·d·sc − dmin·m``). Q4_K's bytes: 4 bits of code + a bf16 scale and zero per 32 = 5 bits a weight,
    1.11× the file's 4.5.
  - Q8_0, Q5_0, Q5_1, Q5_K: codes up to 8 bits split exactly into two 4-bit planes, ``c = 16·hi + lo``, run as
    one kernel call over the input written twice (``[x, x]``). Same values as the file; 10 bits a weight
    (Q5_K: 1.82× its 5.5, Q8_0: 1.18× its 8.5). The alternatives measured for 5-bit codes lose values
    (int8 per row) or hold more bytes (dense bf16, 16 bits).
  - Q6_K: its per-16 scales do not fit the kernel's one scale per 32: :func:`regroup_to_32` makes the
    nearest group-32 8-bit codes (half of them exact, the rest within an eighth of a Q6_K step), two planes,
    1.52× the file's 6.56 bits. Measured against the alternatives on SmolLM2-135M Q6_K (ffn_down; KL to
    llama.cpp added over the fp32 decoder, ffn_down bytes vs the file, decode tok/s bf16 1 thread on an
    AVX512-BF16 CPU): exact four planes 0.00020 nats, 3.05×, 34.9; regrouped 0.00030, 1.52×, 39.6; dense bf16
    0.00029, 2.44×, 33.6; int8 per row 0.00148, 1.22×, 30.3. Regrouped: the fewest bytes at the dense
    path's fidelity, and the fastest.

  A fused linear whose parts need different plane counts runs one call per run of alike parts
  (:class:`StackedLinear`).
- :class:`Int8Linear`: ``torch.ops.aten._weight_int8pack_mm``: signed 8-bit codes, one scale per output row
  (the kernel has no groups), so GGUF blocks are re-quantized per row (lossy; ``--quant int8`` only).
- :class:`Fp16Linear`: fbgemm's packed fp16 GEMM (``--quant fp16``, x86 CPUs): fp16 weights, fp32 activations
  and accumulation. Not a 4/8-bit format (twice int4's bytes), but on an AVX2 CPU it decoded as fast as the
  int4 kernel in bf16, prefilled ~2× faster, kept the fp32 path's agreement with llama.cpp, and its cost grows
  least with the batch (``benchmarks/backend_speed.py`` row ``fp16w``, ``batch_throughput.py --quant fp16``).
- :class:`~.w8a8.W8A8Linear`: fbgemm's int8 GEMM with int8 activations (``--quant w8a8``, x86 CPUs): per-row
  int8 weights (lossy on GGUF blocks), the fastest prefill and batches, the one-row decode bound by its 8-bit
  weights' bytes.
- :class:`DenseLinear`: ``F.linear`` on a compute-dtype weight (``--quant none``, and file types the kernels
  do not hold, such as F16, Q2_K, Q3_K); in fp32 on a CPU, oneDNN on a packed copy (:mod:`.onednn`).

Exactness: the codes are exact (Q6_K's regrouped ones aside); the kernels take scale and zero in the
activation dtype, so in bf16 each is rounded to 8 significant bits (relative error ≤ 2⁻⁹, as a bf16 weight
would be), and they return their output in it (bf16: the same rounding of every output); in fp32 they are
exact but an order of magnitude slower. Where that output rounding costs agreement with llama.cpp the
decoder works around it: :mod:`.head` for the logits, an fp32 SwiGLU product in :mod:`.model`.

Kernel choice: the int4 bf16 kernel is the fastest of these per decode token on both CPUs measured (AVX2 and
AVX512-BF16; ``benchmarks/backend_speed.py`` rows, docs/backends.md "Quantized weights"), and the int kernels in fp32 or
fp16 are an order of magnitude slower than in bf16. On an AVX2 CPU ggml's integer kernels beat it
(:mod:`.ggml_layers`, ``--quant ggml``, outside this module): ``--quant auto`` measures the two per machine
(:mod:`.quant_probe`). torchao 0.18's int4 CPU layout calls the same aten op, its
int8 weight-only layout was slower than ``_weight_int8pack_mm``, and its PyPI wheel carries no CPU kernels of
its own (the AVX512 ``da8w4`` op is absent).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import onednn
from .w8a8 import W8A8Linear

# GGUF's legacy block and the K-quants' sub-block (Q6_K: 16); also the group of load-time int4 quantization
GROUP = 32
QUANT_MODES = ("auto", "none", "int8", "int4", "fp16", "w8a8", "ggml")
# modes whose kernels (fbgemm's, ggml's) take and return fp32 activations: a half --dtype is refused with them
FP32_QUANT_MODES = ("fp16", "w8a8", "ggml")
# ggml's legacy blocks (32 weights): type → bytes per block
_LEGACY_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
# ggml's K-quant super-blocks (QK_K = 256 weights): type → bytes per super-block
_K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
QK_K = 256
# ggml type names whose blocks map onto :class:`GroupQuant` exactly
GGUF_BLOCK_TYPES = tuple(_LEGACY_BYTES) + tuple(_K_BYTES)
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

    Layouts (ggml-common.h ``block_*``, dequantized as ggml-quants.c ``dequantize_row_*`` does; little-endian,
    fp16 ``d``/``m``/``dmin``):

    - Q4_0 (18 B / 32): d, 16 B of nibbles (weight j low nibble of byte j, weight j+16 the high one); d·(q − 8).
    - Q4_1 (20 B / 32): d, m, nibbles as Q4_0; d·q + m.
    - Q5_0 (22 B / 32): d, uint32 qh (bit j: 5th bit of weight j), nibbles as Q4_0; d·(q − 16).
    - Q5_1 (24 B / 32): d, m, qh, nibbles as Q5_0; d·q + m.
    - Q8_0 (34 B / 32): d, 32 int8; d·q.
    - Q4_K (144 B / 256): d, dmin, 12 B of 6-bit sub-block scales sc and minima m (8 of each), 128 B of
      nibbles (bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c+1 in the high ones); per sub-block of 32,
      (d·sc)·q − dmin·m.
    - Q5_K (176 B / 256): as Q4_K with 32 B qh between scales and nibbles (bit i of qh[l]: 5th bit of weight l
      of sub-block i).
    - Q6_K (210 B / 256): 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, d; per sub-block of 16,
      (d·sc)·(q − 32).

    ``d·sc`` and ``dmin·m`` are exact in fp32 (an fp16 times an integer below 2⁸), so each weight is one
    fp32 ``code · scale + zero``, as ggml and ``gguf.quants.dequantize`` compute it.

    Args:
        raw: [N, blocks · bytes_per_block] uint8, one row of the tensor per row.
        type_name: one of :data:`GGUF_BLOCK_TYPES`.
    Returns:
        [N, K] :class:`GroupQuant`: group 32 (Q6_K: 16); bits 4 for Q4_0/Q4_1/Q4_K (codes 0..15), 8 for the rest
        (codes within int8).
    Raises:
        ValueError: another type, or a row length that is not a whole number of blocks.
    """
    size = _LEGACY_BYTES.get(type_name) or _K_BYTES.get(type_name)
    if size is None:
        raise ValueError(f"no exact int mapping for GGUF type {type_name}")
    N, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"{type_name} row of {row_bytes} bytes is not a whole number of {size}-byte blocks")
    nb = row_bytes // size
    blocks = np.ascontiguousarray(raw).reshape(N, nb, size)
    decode = _decode_k if type_name in _K_BYTES else _decode_legacy
    codes, scale, zero, group = decode(blocks, type_name)
    bits = 4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8
    return GroupQuant(codes.reshape(N, -1).astype(np.int16), scale.reshape(N, -1), zero.reshape(N, -1), group, bits,
                      type_name)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 → [...] float32 (an fp16 field of a block, widened exactly)."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes → [..., 32] codes: low nibbles first, then high (ggml's order within a 32-block)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _decode_legacy(blocks: np.ndarray, type_name: str):
    """[N, nb, size] legacy blocks → (codes [N, nb, 32], scale [N, nb], zero [N, nb], 32)."""
    d = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8), d, np.zeros_like(d), GROUP
    has_min = type_name in ("Q4_1", "Q5_1")
    at = 4 if has_min else 2
    if type_name in ("Q5_0", "Q5_1"):
        qh = blocks[..., at:at + 4].copy().view("<u4")  # [N, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = _nibbles(blocks[..., at + 4:]) | (high << 4)
    else:
        codes = _nibbles(blocks[..., at:])
    if has_min:
        return codes, d, _f16(blocks[..., 2:4]), GROUP
    if type_name == "Q4_0":  # unsigned codes (one kernel plane): d·(q − 8) = d·q + (−8d), exact
        return codes, d, -8.0 * d, GROUP
    # Q5_0: d·(q − 16) = d·c with signed c = q − 16 (two planes either way): the zero is exactly 0
    return codes.astype(np.int16) - 16, d, np.zeros_like(d), GROUP


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] → (sc [..., 8], m [..., 8]), 6 bits each (ggml ``get_scale_min_k4``)."""
    s = s.astype(np.uint16)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _decode_k(blocks: np.ndarray, type_name: str):
    """[N, nb, size] K-quant super-blocks → (codes [N, nb, 256], scale, zero [N, nb, 256 / group], group)."""
    N, nb, _ = blocks.shape
    if type_name == "Q6_K":
        ql = blocks[..., 0:128].reshape(N, nb, 2, 2, 32)         # [half, 32-byte run, l]
        qh = blocks[..., 128:192].reshape(N, nb, 2, 1, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)      # [half, 4 runs of 32, l]
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        codes = (low | (high << 4)).reshape(N, nb, QK_K).astype(np.int16) - 32
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        scale = _f16(blocks[..., 208:210])[..., None] * sc
        return codes, scale, np.zeros_like(scale), 16
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, m = _k_scales(blocks[..., 4:16])
    at = 16 if type_name == "Q4_K" else 48
    qs = blocks[..., at:at + 128].reshape(N, nb, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(N, nb, 8, 32)
    if type_name == "Q5_K":
        qh = blocks[..., 16:48].reshape(N, nb, 1, 32)
        codes = codes | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return codes, d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), GROUP


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


def regroup_to_32(q: GroupQuant) -> GroupQuant:
    """A group-16 weight (Q6_K: ``(d·sc)·c``, c ∈ [−32, 31], zero 0) as the nearest group-32 one with 8-bit codes.

    Each 32-group takes scale ``s = d·sc_a / 4`` of its sub-block ``a`` with the larger ``|sc|``: that sub-block's
    codes become ``4·c`` ∈ [−128, 124], exact; the other one's ``round(c · 4·sc_b / sc_a)``, within ``s / 2`` (an
    eighth of sub-block a's Q6_K step; exact where ``sc_b = sc_a``). Why not exact: the int4 kernel has one
    scale per 32-group, so exact group-16 values need each sub-block in planes of its own, four in all: 3.05×
    the file's bytes (more than dense bf16's 2.44×) against 1.52× here, measured on SmolLM2-135M Q6_K to add
    0.00020 nats of KL to llama.cpp over the fp32 decoder against 0.00030 here (dense bf16 weights: 0.00029).

    Args:
        q: [N, K] with group 16 and zero 0.
    Returns:
        [N, K] group 32, bits 8, source ``Q6_K regrouped``.
    Raises:
        ValueError: a group other than 16, or a nonzero zero.
    """
    if q.group != 16 or np.any(q.zero):
        raise ValueError("only group-16 weights with zero 0 (Q6_K) regroup to 32")
    N, K = q.shape
    c = q.codes.reshape(N, K // 32, 2, 16).astype(np.float64)
    sc = q.scale.reshape(N, K // 32, 2).astype(np.float64)
    big = np.where(np.abs(sc[..., 0]) >= np.abs(sc[..., 1]), sc[..., 0], sc[..., 1]) / 4.0
    big = np.where(big != 0, big, 1.0)  # both sub-blocks scaled 0: every weight is 0 at any scale
    codes = np.clip(np.rint(c * (sc / big[..., None])[..., None]), -128, 127).astype(np.int16)
    return GroupQuant(codes.reshape(N, K), big.astype(np.float32), np.zeros((N, K // 32), np.float32), GROUP, 8,
                      f"{q.source} regrouped")


def kernel_planes(q: GroupQuant,
                  dtype: torch.dtype = torch.float32) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The 4-bit planes whose sum over the input written once per plane is ``q``: what :class:`Int4Linear` packs.

    Each plane is (codes [N, K] 0..15, scale [N, K // 32], zero [N, K // 32]) in the kernel's form
    ``(code − 8) · scale + zero``, groups of 32:

    - 4-bit codes (Q4_0, Q4_1, Q4_K, from float): one plane, zero + 8·scale as its zero.
    - codes within int8 (Q8_0, Q5_0, Q5_1, Q5_K, regrouped Q6_K): ``c = 16·hi + lo`` (arithmetic shift:
      hi ∈ [−8, 7], lo ∈ [0, 15]); plane hi with scale 16·s and the group's zero z rounded to ``dtype``
      (the kernel holds it so), plane lo with scale s and zero 8·s + (z − that rounding). Exact; in a half
      dtype the two zeros together then round z to about 8·s·2⁻⁹, not |z|·2⁻⁹ (Q5_1/Q5_K's minima are
      several steps large).

    Raises:
        ValueError: a group other than 32 (see :func:`regroup_to_32`).
    """
    if q.group != GROUP:
        raise ValueError(f"int4 kernel runs groups of {GROUP}, not {q.group}")
    if q.bits == 4:
        return [(q.codes, q.scale, q.zero + 8.0 * q.scale)]
    codes = q.codes.astype(np.int16)
    hi, lo = codes >> 4, codes & 0x0F
    z_hi = torch.from_numpy(q.zero).to(dtype).float().numpy()
    return [(hi + 8, 16.0 * q.scale, z_hi), (lo, q.scale, 8.0 * q.scale + (q.zero - z_hi))]


class Int4Linear:
    """4-bit weight-only linear over torch's packed int4 kernel, groups of 32 along the input.

    The weight is held as the 4-bit planes of :func:`kernel_planes`, side by side along the input, and run as one
    kernel call over the input written once per plane (``[x, x]`` for two): one plane for 4-bit codes, two for
    5-bit to 8-bit ones. The values are ``q``'s exactly.

    Args:
        q: [N, K] quantized weight, group 32.
        b: [N] float32 bias or None.
        device: CPU or CUDA; dtype: the activation dtype (scales are held in it; CUDA needs bf16).
    Raises:
        ValueError: a group :func:`kernel_planes` cannot map, or a CUDA dtype other than bf16.
    """

    def __init__(self, q: GroupQuant, b: np.ndarray | None, device: torch.device, dtype: torch.dtype):
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError("the CUDA int4 kernel needs --dtype bf16")
        planes = kernel_planes(q, dtype)
        codes, scale, zero = (np.concatenate([p[i] for p in planes], axis=1) for i in range(3))
        self.repeat = len(planes)
        N = q.shape[0]
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
        # one entry per source type, so the model line can say what each became (Q8_0 → ``int4×2``)
        planes_tag = f"×{self.repeat}" if self.repeat > 1 else ""
        self.kind = "/".join(f"int4{planes_tag} ({src})" for src in q.source.split("/"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, N] in x's dtype (which must be the dtype the scales were built in)."""
        if self.repeat > 1:
            x = torch.cat([x] * self.repeat, dim=-1)
        y = self._mm(x, self.packed, GROUP, self.scale_zero)
        if y.shape[-1] != self.n_out:
            y = y[..., :self.n_out]
        return y if self.b is None else y + self.b

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero, self.b) if t is not None)


class StackedLinear:
    """Linears over the same input whose outputs are stacked: a fused projection (QKV, gate/up) whose parts need
    different kernel layouts (a Q4_K_M file's Q4_K Q/K beside a Q6_K V), each part in its own.

    Args:
        parts: the linears, in output order.
    """

    def __init__(self, parts: list["Linear"]):
        self.parts = parts
        self.kind = "/".join(dict.fromkeys(k for p in parts for k in p.kind.split("/")))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] → [T, ΣN_i]."""
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


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
        self.kind = "/".join(f"int8 (from {src})" for src in source.split("/"))  # one entry per source type

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


Linear = DenseLinear | Int4Linear | Int8Linear | Fp16Linear | StackedLinear
Weight = np.ndarray | GroupQuant


def make_linear(parts: list[Weight], bias: np.ndarray | None, mode: str, device: torch.device,
                dtype: torch.dtype) -> Linear:
    """One linear from the row blocks ``parts`` (fused QKV, gate/up) under ``--quant`` ``mode``.

    ``auto`` keeps GGUF blocks in the int4 kernel (exact; Q6_K by :func:`regroup_to_32`) and float weights
    dense (a fused linear with any float part too); ``int4`` also quantizes float weights (group 32,
    asymmetric); ``int8`` re-quantizes everything per row; ``w8a8`` too, with int8 activations
    (:class:`~.w8a8.W8A8Linear`, fbgemm, CPU); ``fp16`` holds every weight in fp16 for fbgemm's
    fp32-compute GEMM (:class:`Fp16Linear`, CPU); ``none`` is dense. Under ``int4``/``auto`` the parts of a
    fused linear share one kernel call when they have the same plane count (Q5_0 Q/K with a Q8_0 V), and
    otherwise run one call per run of alike parts (:class:`StackedLinear`: a Q4_K Q/K with a Q6_K V).

    Args:
        parts: [N_i, K] float32 arrays or :class:`GroupQuant` (same K), stacked in order.
        bias: [ΣN_i] float32 or None.
        mode: resolved ``--quant`` (auto, none, int8, int4, fp16, w8a8).
    Raises:
        ValueError: ``fp16`` or ``w8a8`` where fbgemm is missing.
    """
    all_blocks = all(isinstance(p, GroupQuant) for p in parts)
    if mode == "none" or (mode == "auto" and not all_blocks):
        return DenseLinear(_stack_dense(parts), bias, device, dtype)
    if mode == "fp16":
        return Fp16Linear(_stack_dense(parts), bias)
    if mode in ("int8", "w8a8"):
        src = "/".join(sorted({p.source if isinstance(p, GroupQuant) else "float" for p in parts}))
        if mode == "w8a8":
            return W8A8Linear(_stack_dense(parts), bias, source=src)
        return Int8Linear(_stack_dense(parts), bias, device, dtype, source=src)
    K = parts[0].shape[1]
    if K % GROUP:  # no group fits: the kernel cannot hold it
        return DenseLinear(_stack_dense(parts), bias, device, dtype)
    qs = [quantize_int4(p) if not isinstance(p, GroupQuant) else regroup_to_32(p) if p.group != GROUP else p
          for p in parts]
    runs: list[list[GroupQuant]] = []   # consecutive parts of one layout share a kernel call
    for q in qs:
        if runs and (runs[-1][0].group, runs[-1][0].bits) == (q.group, q.bits):
            runs[-1].append(q)
        else:
            runs.append([q])
    linears, row = [], 0
    for run in runs:
        n = sum(q.shape[0] for q in run)
        linears.append(Int4Linear(GroupQuant.concat(run), None if bias is None else bias[row:row + n], device, dtype))
        row += n
    return linears[0] if len(linears) == 1 else StackedLinear(linears)


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
