"""ggml's CPU kernels called from torch: small ggml graphs over the GGUF's own blocks, through ctypes.

llama.cpp multiplies a quantized weight block by an activation block quantized on the fly to 8 bits
(Q4_1 × Q8_1, Q4_K × Q8_K ...), with integer dot products: ``vpmaddubsw`` on AVX2, VNNI where the CPU has it.
torch has no CPU kernel that takes a scale per 32 weights with int8 activations, and its int4 kernel computes
in bf16, which AVX2 CPUs lack. The ggml library that llama-cpp-python already ships has those kernels, for every
GGUF type, reading the file's bytes as they are. This module builds ggml graphs (``mul_mat``, ``rms_norm``,
``silu``, ``mul``, ``add``, ``get_rows``, ``concat``, ``rope_ext``, ``flash_attn_ext``, ``soft_max_ext``,
``out_prod``, ``cpy``, ``cont`` and views) whose
weights point into the GGUF's memory map and whose inputs and outputs point at torch tensors, and runs them on a
ggml thread pool kept for the process.

Weights whose type ggml's CPU backend repacks for this CPU (Q4_0, Q4_K, IQ4_NL ...) are copied once into its
repacking buffer, as llama.cpp loads them (:class:`PackedWeight`); the others are used in place.

Only ggml's public C API is used (``ggml.h``, ``ggml-cpu.h``, ``ggml-backend.h``). Fields of ``struct ggml_tensor``
written directly: ``data`` (ggml has no setter; llama.cpp's own allocators write it the same way), and, of a view
over a block of keys or values, ``ne[1]`` (the positions attended, one more each decode step) and its strides
``nb[1..3]``, and the length of the intermediates that follow a fork's own block (its scores and their softmax;
:mod:`.ggml_decode`; each graph was planned for the longest such view it takes, and rows keep the planned strides).
``extra`` is read: the repacking buffer marks the tensors it has a layout for there. The struct's layout is checked
against ``ggml_get_data``/``ggml_nbytes`` and a view's source and offset on real tensors before anything runs, and a
build whose layout differs reports itself unavailable rather than guessing.

Source: ggml's C API as vendored by llama-cpp-python (``vendor/llama.cpp/ggml/include``); the type ids are
gguf's ``GGMLQuantizationType``, the same enum.
"""

from __future__ import annotations

import ctypes as C
import functools
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch

P = C.c_void_p
TYPE_F32, TYPE_I32 = 0, 26
ROPE_NEOX = 2   # GGML_ROPE_TYPE_NEOX: rotate-half pairs (i, i + d/2)
_ALIGN = 64


class _InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", P), ("no_alloc", C.c_bool)]


class _Tensor(C.Structure):
    # struct ggml_tensor (ggml.h), GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64 bytes, GGML_MAX_SRC 10, GGML_MAX_NAME 64
    _fields_ = [("type", C.c_int), ("buffer", P), ("ne", C.c_int64 * 4), ("nb", C.c_size_t * 4), ("op", C.c_int),
                ("op_params", C.c_int32 * 16), ("flags", C.c_int32), ("src", P * 10), ("view_src", P),
                ("view_offs", C.c_size_t), ("data", P), ("name", C.c_char * 64), ("extra", P), ("padding", C.c_char * 8)]


class _CPlan(C.Structure):
    _fields_ = [("work_size", C.c_size_t), ("work_data", P), ("n_threads", C.c_int), ("threadpool", P),
                ("abort_callback", P), ("abort_callback_data", P), ("use_ref", C.c_bool)]


class _PoolParams(C.Structure):
    _fields_ = [("cpumask", C.c_bool * 512), ("n_threads", C.c_int), ("prio", C.c_int), ("poll", C.c_uint32),
                ("strict_cpu", C.c_bool), ("paused", C.c_bool)]


_DATA = _Tensor.data.offset
_LOG_CALLBACK = C.CFUNCTYPE(None, C.c_int, C.c_char_p, P)   # ggml_log_callback


def _library(folder: Path, stem: str) -> C.CDLL:
    suffix = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")
    names = [f"lib{stem}{suffix}", f"{stem}{suffix}"]
    for name in names:
        if (folder / name).exists():
            return C.CDLL(str(folder / name), mode=C.RTLD_GLOBAL)
    raise OSError(f"{' or '.join(names)} not in {folder}")


class _Lib:
    """The bound functions of llama-cpp-python's libggml-base and libggml-cpu."""

    def __init__(self):
        import llama_cpp

        folder = Path(llama_cpp.__file__).parent / "lib"
        base, cpu = _library(folder, "ggml-base"), _library(folder, "ggml-cpu")
        sig = {
            (base, "ggml_init"): ([_InitParams], P), (base, "ggml_free"): ([P], None),
            (base, "ggml_new_tensor_1d"): ([P, C.c_int, C.c_int64], P),
            (base, "ggml_new_tensor_2d"): ([P, C.c_int, C.c_int64, C.c_int64], P),
            (base, "ggml_new_tensor_3d"): ([P, C.c_int, C.c_int64, C.c_int64, C.c_int64], P),
            (base, "ggml_reshape_2d"): ([P, P, C.c_int64, C.c_int64], P),
            (base, "ggml_reshape_3d"): ([P, P, C.c_int64, C.c_int64, C.c_int64], P),
            (base, "ggml_view_3d"): ([P, P, C.c_int64, C.c_int64, C.c_int64, C.c_size_t, C.c_size_t, C.c_size_t], P),
            (base, "ggml_cpy"): ([P, P, P], P), (base, "ggml_concat"): ([P, P, P, C.c_int], P),
            (base, "ggml_rope_ext"): ([P, P, P, P, C.c_int, C.c_int, C.c_int] + [C.c_float] * 6, P),
            (base, "ggml_flash_attn_ext"): ([P, P, P, P, P, C.c_float, C.c_float, C.c_float], P),
            (base, "ggml_mul_mat"): ([P, P, P], P), (base, "ggml_add"): ([P, P, P], P),
            (base, "ggml_soft_max_ext"): ([P, P, P, C.c_float, C.c_float], P),
            (base, "ggml_out_prod"): ([P, P, P], P), (base, "ggml_cont"): ([P, P], P),
            (base, "ggml_mul"): ([P, P, P], P), (base, "ggml_silu"): ([P, P], P),
            (base, "ggml_rms_norm"): ([P, P, C.c_float], P), (base, "ggml_get_rows"): ([P, P, P], P),
            (base, "ggml_new_graph_custom"): ([P, C.c_size_t, C.c_bool], P),
            (base, "ggml_build_forward_expand"): ([P, P], None),
            (base, "ggml_tensor_overhead"): ([], C.c_size_t), (base, "ggml_graph_overhead_custom"): ([C.c_size_t, C.c_bool], C.c_size_t),
            (base, "ggml_nbytes"): ([P], C.c_size_t), (base, "ggml_get_data"): ([P], P),
            (base, "ggml_threadpool_params_default"): ([C.c_int], _PoolParams),
            (cpu, "ggml_threadpool_new"): ([C.POINTER(_PoolParams)], P),
            (cpu, "ggml_graph_plan"): ([P, C.c_int, P], _CPlan),
            (cpu, "ggml_graph_compute"): ([P, C.POINTER(_CPlan)], C.c_int),
            (cpu, "ggml_cpu_init"): ([], None),
            # ggml-backend: the CPU backend's repacking buffer type (llama.cpp's CPU_REPACK weights)
            (cpu, "ggml_backend_cpu_reg"): ([], P),
            (base, "ggml_backend_reg_dev_get"): ([P, C.c_size_t], P),
            (base, "ggml_backend_reg_get_proc_address"): ([P, C.c_char_p], P),
            (base, "ggml_backend_buft_name"): ([P], C.c_char_p),
            (base, "ggml_backend_alloc_ctx_tensors_from_buft"): ([P, P], P),
            (base, "ggml_backend_buffer_free"): ([P], None),
            (base, "ggml_backend_buffer_get_size"): ([P], C.c_size_t),
            (base, "ggml_backend_tensor_set"): ([P, P, C.c_size_t, C.c_size_t], None),
            (base, "ggml_log_set"): ([P, P], None), (base, "ggml_set_name"): ([P, C.c_char_p], P),
        }
        for (lib, name), (args, res) in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
            setattr(self, name.removeprefix("ggml_"), fn)
        # the ggml these files hold may be a copy of its own beside llama.cpp's (file names differ), with a log
        # of its own: silenced as llama.cpp's is (ZOOMR_DEBUG=1 keeps it)
        if os.environ.get("ZOOMR_DEBUG", "") in ("", "0"):
            self._quiet = _LOG_CALLBACK(lambda level, text, data: None)
            self.log_set(C.cast(self._quiet, P), None)
        self.cpu_init()
        self._check_layout()

    @functools.cached_property
    def repack_buft(self) -> int | None:
        """The CPU backend's ``CPU_REPACK`` buffer type, or None where this build has none."""
        reg = self.backend_cpu_reg()
        get = reg and self.backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not get:
            return None
        bufts = C.CFUNCTYPE(C.POINTER(P), P)(get)(self.backend_reg_dev_get(reg, 0))
        i = 0
        while bufts and bufts[i]:
            if self.backend_buft_name(bufts[i]) == b"CPU_REPACK":
                return bufts[i]
            i += 1
        return None

    def _check_layout(self) -> None:
        # a real allocated tensor: our struct must find its sizes and data pointer where ggml keeps them
        ctx = self.init(_InitParams(4096, None, False))
        try:
            t = self.new_tensor_2d(ctx, TYPE_F32, 3, 2)
            s = _Tensor.from_address(t)
            # a view: where its source and offset sit (views of the KV cache are re-pointed per step)
            v = _Tensor.from_address(self.view_3d(ctx, t, 3, 1, 1, 12, 12, 12))
            self.set_name(t, b"zoomr")   # the name, then extra (read for repacked weights) sit where we read them
            if (s.name != b"zoomr" or s.extra or s.data != self.get_data(t) or list(s.ne) != [3, 2, 1, 1] or s.nb[1] != 12
                    or self.nbytes(t) != 24 or s.type != TYPE_F32 or v.view_src != t or v.view_offs != 12
                    or v.data != s.data + 12 or list(v.ne) != [3, 1, 1, 1]):
                raise OSError("struct ggml_tensor in this llama-cpp-python build differs from the layout zoomr reads")
        finally:
            self.free(ctx)


@functools.cache
def lib() -> _Lib:
    """The ggml library, bound and checked once per process.

    Raises:
        OSError: llama-cpp-python's ggml libraries are missing or their tensor layout differs.
    """
    return _Lib()


def available() -> bool:
    """ggml's CPU kernels can be called here (llama-cpp-python installed, its ggml's tensor layout as expected)."""
    try:
        lib()
        return True
    except (ImportError, OSError, AttributeError):
        return False


_pools: dict[int, int] = {}
_pool_lock = threading.Lock()


def thread_pool(n_threads: int) -> int:
    """A ggml thread pool of ``n_threads`` (the calling thread is one of them), made once per process and count.
    Its workers poll for the next graph a short while before sleeping, as llama.cpp's do between graphs."""
    with _pool_lock:
        if n_threads not in _pools:
            params = lib().threadpool_params_default(n_threads)
            _pools[n_threads] = lib().threadpool_new(C.byref(params))
        return _pools[n_threads]


def _repack_wanted() -> bool:
    return os.environ.get("ZOOMR_GGML_REPACK", "1") not in ("0", "false", "no", "off")


class PackedWeight:
    """A weight copied once into ggml's CPU repacking buffer, in the interleaved layout that ggml's CPU backend
    picks for this CPU and type (Q4_0 and Q4_K as 8 rows × 8 bytes on AVX2/AVX512, IQ4_NL, Q2_K ...), which
    its ``mul_mat`` multiplies with dedicated GEMV/GEMM kernels. It is what llama.cpp loads by default (its
    ``CPU_REPACK`` buffer; ``--no-repack`` turns it off). Used as a ``mul_mat`` operand only (not ``get_rows``).

    Build with :meth:`of`; the tensor lives as long as this object.

    Attributes:
        tensor: the ggml tensor, ggml shape (K, N); nbytes: bytes of its buffer.
    """

    def __init__(self, ctx: int, buffer: int, tensor: int):
        self._ctx, self._buffer, self.tensor = ctx, buffer, tensor
        self.nbytes = lib().backend_buffer_get_size(buffer)

    @staticmethod
    def of(data: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> "PackedWeight | None":
        """``data`` ([N, row bytes], C-contiguous, the file's blocks) repacked, or None where this CPU has no
        repacked layout for the type and shape (Q4_1, Q5_0, Q8_0, K-quants other than Q2_K/Q4_K on x86 ...), the
        build has no repacking buffer, or ``ZOOMR_GGML_REPACK=0`` asks for the file's layout.

        Source: ggml-cpu's ``repack.cpp`` (``ggml_backend_cpu_repack_buffer_type``), as llama.cpp's loader uses it.
        """
        L = lib()
        if len(shape) != 2 or not data.flags.c_contiguous or not _repack_wanted() or L.repack_buft is None:
            return None
        ctx = L.init(_InitParams(L.tensor_overhead() * 2, None, True))
        t = L.new_tensor_2d(ctx, ggml_type, shape[1], shape[0])
        buf = L.backend_alloc_ctx_tensors_from_buft(ctx, L.repack_buft) if L.nbytes(t) == data.nbytes else None
        # the buffer's init marks a tensor it has a layout for (``extra``: the repacking kernels); the others
        # would be stored as they are, which the plain tensor over the file's bytes already does
        if not buf or not _Tensor.from_address(t).extra:
            if buf:
                L.backend_buffer_free(buf)
            L.free(ctx)
            return None
        L.backend_tensor_set(t, data.ctypes.data, 0, data.nbytes)
        return PackedWeight(ctx, buf, t)

    def __del__(self):
        try:
            L = lib()
            L.backend_buffer_free(self._buffer)
            L.free(self._ctx)
        except Exception:   # interpreter shutdown: the library may be gone already
            pass


class Builder:
    """Records a ggml graph: weights (tensors over caller-owned memory), inputs and outputs (torch tensors bound
    at each run) and the ops between them; :meth:`finish` turns it into a :class:`Graph`.

    Shapes follow torch: an [S, K] row-major tensor is ggml's ne = (K, S).
    """

    def __init__(self, max_tensors: int = 64):
        L = lib()
        self.L = L
        self.ctx = L.init(_InitParams(L.tensor_overhead() * max_tensors + L.graph_overhead_custom(max_tensors, False),
                                      None, True))
        self.max_tensors = max_tensors
        self.keep: list = []                   # memory the weights point into
        self.inputs: dict[str, int] = {}
        self.temps: list[int] = []             # intermediates: placed in the graph's arena (views alias)
        self.order: list[int] = []             # copies into external memory, expanded first

    def weight(self, data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> int:
        """A tensor over ``data`` (C-contiguous bytes as ggml lays the type out), torch ``shape`` [N, K] or [K]."""
        if not data.flags.c_contiguous:
            raise ValueError("ggml weights must be C-contiguous")
        ne = tuple(reversed(shape))
        t = (self.L.new_tensor_1d(self.ctx, ggml_type, *ne) if len(ne) == 1
             else self.L.new_tensor_2d(self.ctx, ggml_type, *ne))
        if self.L.nbytes(t) != data.nbytes:
            raise ValueError(f"ggml type {ggml_type} {shape} needs {self.L.nbytes(t)} bytes, got {data.nbytes}")
        P.from_address(t + _DATA).value = data.ctypes.data
        self.keep.append(data)
        return t

    def input(self, name: str, rows: int, cols: int, ggml_type: int = TYPE_F32) -> int:
        """An input bound at run time to a contiguous torch tensor [rows, cols] (float32, or int32 for I32)."""
        t = self.L.new_tensor_2d(self.ctx, ggml_type, cols, rows) if cols > 1 else \
            self.L.new_tensor_1d(self.ctx, ggml_type, rows)
        self.inputs[name] = t
        return t

    def _op(self, t: int) -> int:
        self.temps.append(t)
        return t

    def mul_mat(self, w: int, x: int) -> int:
        """``x @ wᵀ``: w [N, K] (any ggml type), x [S, K] float32 → [S, N] float32; x is quantized per row to
        w's dot-product type inside (Q8_0/Q8_1/Q8_K for quantized w)."""
        return self._op(self.L.mul_mat(self.ctx, w, x))

    def add(self, a: int, b: int) -> int:
        """``a + b``, a [S, N], b [S, N] or [N] (broadcast over rows) → [S, N]."""
        return self._op(self.L.add(self.ctx, a, b))

    def mul(self, a: int, b: int) -> int:
        """``a · b`` elementwise, a [S, N], b [S, N] or [N] (broadcast over rows) → [S, N]."""
        return self._op(self.L.mul(self.ctx, a, b))

    def silu(self, a: int) -> int:
        """``a · sigmoid(a)`` elementwise → a's shape."""
        return self._op(self.L.silu(self.ctx, a))

    def rms_norm(self, x: int, w: int, eps: float) -> int:
        """RMSNorm of each row times the weight ``w`` [cols], as llama.cpp's graph computes it."""
        return self.mul(self._op(self.L.rms_norm(self.ctx, x, eps)), w)

    def get_rows(self, table: int, ids: int) -> int:
        """Rows ``ids`` ([T] int32) of ``table`` ([V, K], any ggml type), dequantized → [T, K] float32."""
        return self._op(self.L.get_rows(self.ctx, table, ids))

    def external(self, ne: tuple[int, int, int]) -> int:
        """A float32 tensor of ggml shape ``ne`` over memory the caller points it at before each run
        (:meth:`Graph.fields`, in :meth:`Graph.run`'s ``prepare``): a KV-cache buffer. Views of it follow it."""
        return self.L.new_tensor_3d(self.ctx, TYPE_F32, *ne)

    def view3(self, a: int, ne: tuple[int, int, int], nb1: int, nb2: int, offset: int = 0) -> int:
        """A strided view of ``a`` (ggml order: ``ne`` = (cols, rows, slices), strides in bytes)."""
        return self._op(self.L.view_3d(self.ctx, a, *ne, nb1, nb2, offset))

    def reshape(self, a: int, *ne: int) -> int:
        """``a`` (contiguous) seen with ggml shape ``ne`` (2 or 3 dims), a view."""
        fn = self.L.reshape_2d if len(ne) == 2 else self.L.reshape_3d
        return self._op(fn(self.ctx, a, *ne))

    def concat(self, a: int, b: int, dim: int = 0) -> int:
        """``a`` then ``b`` along ggml dimension ``dim`` (the others equal; 0: [S, Na] and [S, Nb] side by side →
        [S, Na + Nb]); the inputs may be strided views."""
        return self._op(self.L.concat(self.ctx, a, b, dim))

    def copy_into(self, a: int, dst: int) -> int:
        """Copy ``a`` into ``dst`` (same element count), ordered before every op built after it."""
        t = self._op(self.L.cpy(self.ctx, a, dst))
        self.order.append(t)
        return t

    def rope(self, x: int, pos: int, freq_factors: int | None, n_dims: int, base: float) -> int:
        """Rotate-half (NeoX) RoPE of ``x`` (ggml shape (d, heads, S), rows may be strided) at ``pos`` ([S] int32):
        angle ``pos · base^(-2i/n_dims) / freq_factors[i]`` for pair i, computed as llama.cpp computes it."""
        return self._op(self.L.rope_ext(self.ctx, x, pos, freq_factors, n_dims, ROPE_NEOX, 0, base, 1.0, 0.0, 1.0,
                                        0.0, 0.0))

    def flash_attn(self, q: int, k: int, v: int, scale: float) -> int:
        """Softmax attention without a mask (every key visible): q ggml (d, S, H), k and v (d, n, Hkv) with
        H a multiple of Hkv (grouped-query) → (d, H, S)."""
        return self._op(self.L.flash_attn_ext(self.ctx, q, k, v, None, scale, 0.0, 0.0))

    def soft_max(self, a: int, scale: float) -> int:
        """``softmax(scale · a)`` along ggml dimension 0 (each row), no mask → a's shape."""
        return self._op(self.L.soft_max_ext(self.ctx, a, None, scale, 0.0))

    def out_prod(self, a: int, b: int) -> int:
        """Σ over ggml dimension 1 of a's columns times b's: a (m, n, A), b (p, n, B) with B a multiple of A
        (grouped: slice j of b pairs with slice j // (B/A) of a) → (m, p, B)."""
        return self._op(self.L.out_prod(self.ctx, a, b))

    def cont(self, a: int) -> int:
        """A contiguous copy of ``a`` (a strided view)."""
        return self._op(self.L.cont(self.ctx, a))

    def finish(self, outputs: dict[str, int | tuple[int, int]], n_threads: int) -> "Graph":
        """The graph computing ``outputs`` (each an op's result, written into a fresh torch tensor per run; a
        value ``(tensor, 3)`` asks for a 3-D torch tensor, else 2-D). Copies made with :meth:`copy_into` run
        first, in the order they were built."""
        g = self.L.new_graph_custom(self.ctx, self.max_tensors, False)
        for t in self.order:
            self.L.build_forward_expand(g, t)
        for t in outputs.values():
            self.L.build_forward_expand(g, t if isinstance(t, int) else t[0])
        return Graph(self, g, outputs, n_threads)


class _Scratch:
    """Memory for graph intermediates and work buffers, one block for the process: only one graph computes at a
    time (``_compute_lock``), and nothing in it outlives a compute. It grows to the largest graph run so far."""

    def __init__(self):
        self._buf = np.empty(0, np.uint8)
        self.base = 0

    def ensure(self, nbytes: int) -> int:
        """The 64-aligned base address of at least ``nbytes`` bytes (moves when it grows)."""
        if self._buf.nbytes < nbytes + _ALIGN:
            self._buf = np.empty(nbytes + nbytes // 4 + _ALIGN, np.uint8)
            self.base = -(-self._buf.ctypes.data // _ALIGN) * _ALIGN
        return self.base


_scratch = _Scratch()


class Graph:
    """A built ggml graph: :meth:`run` binds torch inputs, computes on the thread pool and returns the outputs.

    Intermediates (bytes: the sum of their sizes, 64-aligned) and the plan's work buffer (activations quantized
    to the weights' dot-product type) live in memory shared by every graph of the process, placed at each run
    where it moved: a graph per prompt length used to fault in arenas of its own, hundreds of MB for a batched
    prefill.
    """

    def __init__(self, b: Builder, g: int, outputs: dict[str, int], n_threads: int):
        L = lib()
        self._b, self._g, self.L = b, g, L
        dims = {k: (v, 2) if isinstance(v, int) else v for k, v in outputs.items()}
        outputs = {k: t for k, (t, _) in dims.items()}
        out_ids = set(outputs.values())
        if any(_Tensor.from_address(t).view_src for t in out_ids):   # a view op computes nothing to write out
            raise ValueError("a ggml graph output must be an op's own result, not a view")
        # a view has no memory of its own: it points into its source's (ggml keeps the root and the offset)
        temps = [t for t in b.temps if t not in out_ids and not _Tensor.from_address(t).view_src]
        self._temps: list[tuple[C.c_void_p, int]] = []
        at = 0
        for t in temps:
            self._temps.append((P.from_address(t + _DATA), at))
            at += -(-L.nbytes(t) // _ALIGN) * _ALIGN
        placed = set(temps)
        # views of intermediates move with the scratch memory; views of inputs, outputs and external memory
        # follow their root at every run
        self._temp_views: list[tuple[C.c_void_p, C.c_void_p, int]] = []
        self._views: list[tuple[C.c_void_p, C.c_void_p, int]] = []
        for t in b.temps:
            s = _Tensor.from_address(t)
            if s.view_src and t not in out_ids:
                entry = (P.from_address(t + _DATA), P.from_address(s.view_src + _DATA), s.view_offs)
                (self._temp_views if s.view_src in placed else self._views).append(entry)
        self._in = {}
        for k, t in b.inputs.items():
            s = _Tensor.from_address(t)
            shape = (s.ne[1], s.ne[0]) if s.ne[1] > 1 or s.type != TYPE_I32 else (s.ne[0],)
            self._in[k] = (P.from_address(t + _DATA), shape, torch.int32 if s.type == TYPE_I32 else torch.float32)
        self._out = {k: (P.from_address(t + _DATA), tuple(reversed(_Tensor.from_address(t).ne[:dims[k][1]])))
                     for k, t in outputs.items()}
        self._plan = L.graph_plan(g, n_threads, thread_pool(n_threads))
        self._arena_bytes = at
        self._scratch_bytes = at + -(-self._plan.work_size // _ALIGN) * _ALIGN
        self._placed_at = None
        self._plan_ref = C.byref(self._plan)

    def _place(self, base: int) -> None:
        for field, offset in self._temps:
            field.value = base + offset
        for view, root, offset in self._temp_views:
            view.value = root.value + offset
        self._plan.work_data = base + self._arena_bytes
        self._placed_at = base

    def run(self, prepare=None, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Compute once. Inputs: contiguous CPU tensors of the declared shapes (float32; int32 for ids).
        ``prepare``, if given, is called first under the same lock: where it re-points external tensors
        (:meth:`fields`), no other thread's run sees them half-set.

        Returns:
            {output name: [rows, cols] float32 tensor}.
        Raises:
            RuntimeError: ggml reported a failed compute.
        """
        outs = {k: torch.empty(shape) for k, (_, shape) in self._out.items()}
        for k, x in inputs.items():   # ggml reads exactly the declared bytes: anything else would read past them
            _, shape, dtype = self._in[k]
            if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous() or x.device.type != "cpu":
                raise ValueError(f"ggml graph input {k}: expected a contiguous CPU {dtype} tensor {shape}, got "
                                 f"{x.dtype} {tuple(x.shape)}")
        with _compute_lock:   # the pointers belong to this call until the compute ends
            base = _scratch.ensure(self._scratch_bytes)
            if base != self._placed_at:
                self._place(base)
            if prepare is not None:
                prepare()
            for k, x in inputs.items():
                self._in[k][0].value = x.data_ptr()
            for k, y in outs.items():
                self._out[k][0].value = y.data_ptr()
            for view, root, offset in self._views:
                view.value = root.value + offset
            status = self.L.graph_compute(self._g, self._plan_ref)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed (status {status})")
        return outs

    @staticmethod
    def handles(t: int) -> tuple[C.c_void_p, C.Array, C.Array]:
        """Graph tensor ``t``'s ``data``, ``ne`` and ``nb`` as ctypes objects over its struct, made once by a caller
        that re-points it at every run (cheaper per write than :meth:`fields`)."""
        return (P.from_address(t + _DATA), (C.c_int64 * 4).from_address(t + _Tensor.ne.offset),
                (C.c_size_t * 4).from_address(t + _Tensor.nb.offset))

    @staticmethod
    def fields(t: int) -> _Tensor:
        """The struct of graph tensor ``t``, for a caller that re-points an external tensor (``data``) or resizes a
        view of one (``ne``) between runs: the KV cache's buffer moves when it grows and gains a row per step."""
        return _Tensor.from_address(t)

    def __del__(self):
        try:
            self.L.free(self._b.ctx)
        except Exception:   # interpreter shutdown: the library may be gone already
            pass


# graphs share one thread pool per thread count: one compute at a time
_compute_lock = threading.Lock()
