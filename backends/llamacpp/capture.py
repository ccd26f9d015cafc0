"""Each layer's post-RoPE queries and keys, read out of llama.cpp's graph while ``llama_decode`` runs it.

llama.cpp hands no attention scores, queries or keys out through its API; what it offers is an eval callback
(``cb_eval`` in ``llama_context_params``, ggml's ``ggml_backend_sched_eval_callback``). The scheduler asks it about
every graph node before computing it ("do you want this one?") and, for the nodes it wants, calls it again once
the node's data is ready. llama.cpp's model graphs name the rotated queries and keys of layer ``il``
``Qcur-<il>`` and ``Kcur-<il>`` (names llama.cpp also gives the projections before RoPE, so the op is checked
too): a RoPE node of shape [d, heads, tokens]. This module wants exactly those 2 × n_layer nodes and copies
them with ``ggml_backend_tensor_get`` (from a GPU too). Each wanted node splits the scheduler's graph, which
is the callback's cost (``benchmarks/llamacpp_speed.py`` measures it).

Source: llama.cpp ``ggml/include/ggml-backend.h`` (``ggml_backend_sched_eval_callback``), ``src/llama-graph.cpp``
and the model builders under ``src/models/`` (the ``cb(Qcur, "Qcur", il)`` names).
"""

from __future__ import annotations

import ctypes
import re

import numpy as np

_NAME = re.compile(rb"^([QK])cur-(\d+)$")
_DTYPES = {0: np.float32, 1: np.float16}   # ggml_type ids of the element types read here (GGML_TYPE_F32, _F16)


class _TensorHead(ctypes.Structure):
    """The first fields of ``struct ggml_tensor`` (ggml.h), unchanged across ggml's releases: type, buffer,
    ne[4] (elements per dimension), nb[4] (bytes of a step per dimension), op."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int)]


def _ggml():
    """ggml's shared library as llama-cpp-python loaded it, with the prototypes used here; and the ROPE op id."""
    from llama_cpp._ggml import libggml as lib

    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    rope = next((i for i in range(256) if lib.ggml_op_name(i) == b"ROPE"), None)
    return lib, rope


class GraphNamesError(ValueError):
    """The model's llama.cpp graph does not name its rotated queries and keys as :class:`KQCapture` expects."""


class KQCapture:
    """Copies the rotated queries and keys of every layer during each ``llama_decode`` of one context.

    Install :attr:`callback` as the context's ``cb_eval`` (:func:`zoomr.backends.llamacpp.runtime.new_context`),
    call :meth:`begin` before a decode and :meth:`take` after it. An exception inside the callback is never
    raised there (ctypes would print it and go on): it is kept and :meth:`take` raises it.

    Args:
        n_layer: layers; n_head, n_head_kv: query and KV heads per layer; head_dim: elements per head.
    Attributes:
        callback: the ctypes callback object (keep a reference for the context's lifetime).
    """

    def __init__(self, n_layer: int, n_head: int, n_head_kv: int, head_dim: int):
        self.lib, self.rope = _ggml()
        self.shape = (n_layer, n_head, n_head_kv, head_dim)
        self._parts: dict[tuple[bytes, int], list[np.ndarray]] = {}
        self._error: BaseException | None = None
        import llama_cpp

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)

    def begin(self) -> None:
        """Forget what the previous decode left."""
        self._parts, self._error = {}, None

    def _on_tensor(self, tensor: int, ask: bool, _user_data) -> bool:
        # ask: True wants the node; data phase: False would stop the graph, so it is always True
        try:
            head = _TensorHead.from_address(tensor)
            match = _NAME.match(self.lib.ggml_get_name(tensor) or b"") if head.op == self.rope else None
            if ask:
                return match is not None
            if match is not None:
                self._copy(tensor, head, match.group(1), int(match.group(2)))
        except BaseException as e:  # noqa: BLE001 - take() raises it; raised here, ctypes would print and go on
            if self._error is None:
                self._error = e
            return not ask
        return True

    def _copy(self, tensor: int, head: _TensorHead, which: bytes, layer: int) -> None:
        d, heads, tokens = head.ne[0], head.ne[1], head.ne[2]
        dtype = _DTYPES.get(head.type)
        if dtype is None or head.ne[3] != 1:
            raise GraphNamesError(f"{which.decode()}cur-{layer} is a ggml type {head.type} tensor of shape "
                                  f"{tuple(head.ne)}, not [d, heads, tokens] floats")
        size = np.dtype(dtype).itemsize
        if head.nb[0] != size or head.nb[1] != size * d or head.nb[2] != size * d * heads:
            raise GraphNamesError(f"{which.decode()}cur-{layer} is not contiguous")
        out = np.empty((tokens, heads, d), dtype=dtype)
        self.lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        self._parts.setdefault((which, layer), []).append(out)

    def take(self, n_tokens: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """What the last decode computed: per layer the queries [T, H, d] and keys [T, Hkv, d] (float32, rows in
        the batch's order, ubatches concatenated).

        Args:
            n_tokens: T, the tokens of the decode (checks that every row was seen).
        Raises:
            GraphNamesError: a layer whose ``Qcur``/``Kcur`` was not found or has another shape (a model whose
                graph names them otherwise), or an error inside the callback.
        """
        if self._error is not None:
            error, self._error = self._error, None
            raise error if isinstance(error, GraphNamesError) else GraphNamesError(str(error))
        L, H, Hkv, d = self.shape
        out = {}
        for which, heads in ((b"Q", H), (b"K", Hkv)):
            rows = []
            for layer in range(L):
                parts = self._parts.get((which, layer))
                if not parts:
                    raise GraphNamesError(f"no rotated {which.decode()}cur-{layer} in the graph")
                x = parts[0] if len(parts) == 1 else np.concatenate(parts)
                if x.shape != (n_tokens, heads, d):
                    raise GraphNamesError(f"{which.decode()}cur-{layer} has shape {x.shape[::-1]}, expected "
                                          f"[{d}, {heads}, {n_tokens}]")
                rows.append(x.astype(np.float32, copy=False))
            out[which] = rows
        self._parts = {}
        return out[b"Q"], out[b"K"]
