"""The torch backend: our decoder + a pluggable per-sequence KV cache, behind :class:`zoomr.backends.base.Backend`."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from zoomr.backends.base import KVStats, check_batch
from zoomr.backends.models import ModelSource
from zoomr.backends.tokenizer import HFTokenizer, LlamaCppTokenizer
from zoomr.kvstore.base import FullKVCache, KVCache
from zoomr.kvstore.registry import REFERENCE, PolicySpec

from .calibrate import bind_query_stats
from .model import Decoder, default_kv_dtype
from .ggml_ops import available as ggml_available
from .quant import FP32_QUANT_MODES, check_quant, fp16_gemm_available
from .w8a8 import available as w8a8_available
from .weights import load_gguf, load_hf_dir

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


DEVICES = ("auto", "cpu", "cuda", "cuda:N")


def pick_device(spec: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; otherwise ``torch.device(spec)`` for ``cpu``, ``cuda``, ``cuda:N``.

    Raises:
        ValueError: CUDA requested but not available, or any other device string (naming ``--device`` and
            the choices).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        dev = None
    # torch also names devices (meta, mps, xpu ...) this backend was never run on
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r} unknown (choose from {', '.join(DEVICES)})")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but torch sees no CUDA device")
    return dev


def pick_dtype(spec: str, device: torch.device, kernel: str = "dense") -> torch.dtype:
    """``auto`` → bf16 on CUDA; on a CPU the faster of bf16 and fp16 for the kernel the linears run, measured
    once per machine (:func:`zoomr.backends.torch.dtype_probe.cpu_half_dtype`): decode is memory-bound and a
    half-size type halves the bytes per token, but which one this CPU computes faster varies.

    Args:
        spec: ``auto``, ``fp32``, ``bf16``, ``fp16`` (or the long names).
        kernel: what the model's linears run: ``dense``, ``int4``, ``int8``, or ``fp16``/``w8a8`` (fbgemm: always
            fp32).
    Raises:
        ValueError: an unknown dtype name (naming ``--dtype`` and every choice, ``auto`` included), or a
            half dtype for the ``fp16``/``w8a8`` kernels.
    """
    if kernel in FP32_QUANT_MODES:  # fbgemm's fp16 and int8 GEMMs take and return fp32 activations
        if spec in ("auto", "fp32", "float32"):
            return torch.float32
        lib = "ggml" if kernel == "ggml" else "fbgemm"
        raise ValueError(f"--quant {kernel} computes in fp32 ({lib} takes fp32 activations): use --dtype fp32 "
                         f"or auto, not {spec}")
    if spec == "auto":
        if device.type == "cpu":
            from .dtype_probe import cpu_half_dtype

            return cpu_half_dtype(kernel)
        return torch.bfloat16
    if spec not in DTYPES:
        raise ValueError(f"--dtype {spec!r} unknown (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[spec]


def pick_kv_dtype(spec: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype (``--kv-dtype``, llama.cpp's ``--cache-type-k/-v``): ``auto`` → the compute dtype on
    CUDA, fp32 on a CPU (:func:`zoomr.backends.torch.model.default_kv_dtype` says why).

    Args:
        spec: ``auto``, ``fp32``, ``bf16``, ``fp16`` (or the long names); device, dtype: where and in what the
            linears compute.
    Raises:
        ValueError: an unknown name (naming ``--kv-dtype`` and every choice).
    """
    check_kv_dtype(spec)
    return default_kv_dtype(device, dtype) if spec == "auto" else DTYPES[spec]


def check_kv_dtype(spec: str) -> str:
    """``spec`` itself when it names a ``--kv-dtype``.

    Raises:
        ValueError: an unknown name (naming ``--kv-dtype`` and every choice).
    """
    if spec != "auto" and spec not in DTYPES:
        raise ValueError(f"--kv-dtype {spec!r} unknown (choose from auto, {', '.join(DTYPES)})")
    return spec


def resolve_quant(quant: str, kind: str, dtype: str) -> str:
    """The ``--quant`` mode a model runs: ``auto`` keeps a GGUF's blocks quantized in a half compute dtype and
    is ``none`` for HF directories and at ``--dtype fp32`` (the exact-check dtype: the int kernels' fp32 paths
    are ~10× slower on CPU, and dense fp32 weights dequantized from the blocks hold the same values).

    Args:
        quant: ``auto``, ``none``, ``int8``, ``int4``, ``fp16``; kind: ``gguf`` or ``hf``; dtype: the ``--dtype`` given.
    Raises:
        ValueError: an unknown mode.
    """
    check_quant(quant)
    if quant != "auto":
        return quant
    return "auto" if kind == "gguf" and DTYPES.get(dtype) != torch.float32 else "none"


def check_ggml(kind: str, device: torch.device) -> None:
    """``--quant ggml`` runs here: a GGUF file, a CPU device, llama-cpp-python's ggml loadable.

    Raises:
        ValueError: otherwise (the message says which).
    """
    if kind != "gguf":
        raise ValueError("--quant ggml runs ggml's kernels on a GGUF file's blocks: this model is not a GGUF file "
                         "(use --quant auto)")
    if device.type != "cpu":
        raise ValueError(f"--quant ggml runs ggml's CPU kernels, not on {device.type} (use --quant auto)")
    if not ggml_available():
        raise ValueError("--quant ggml needs the ggml library of llama-cpp-python, which could not be loaded here "
                         "(use --quant auto)")


@dataclass
class TorchSequence:
    """A sequence of the torch backend: its token ids and its KV cache."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)


CacheFactory = Callable[["TorchBackend"], KVCache]


def _full_cache(backend: "TorchBackend") -> KVCache:
    return FullKVCache(backend.cfg.n_layers, backend.cfg.n_kv_heads, backend.cfg.head_dim, backend.device,
                       backend.kv_dtype)


class TorchBackend:
    """Our own decoder on CUDA or CPU, with any :class:`zoomr.kvstore.base.KVCache` per sequence.

    Args:
        source: resolved model files (GGUF or HF directory).
        device: "auto", "cpu", "cuda", "cuda:1" ...
        dtype: "auto", "fp32", "bf16", "fp16".
        quant: "auto" (keep a GGUF's legacy and K-quant blocks in the int4 kernel, exactly, Q6_K regrouped
            to groups of 32: :func:`zoomr.backends.torch.quant.kernel_planes`; none for HF), "none" (dense in the
            compute dtype), "int8" or "int4" (quantize at load; GGUF Q4 blocks stay exact under int4), "fp16"
            (fp16 weights, fp32 compute, CPU only), "w8a8" (int8 weights and activations, fbgemm, CPU only;
            lossy: :mod:`zoomr.backends.torch.w8a8`). See :mod:`zoomr.backends.torch.quant`.
        n_ctx: most positions a sequence may hold (tokens), ``-c``.
        threads: CPU threads for torch (``-t``); None keeps torch's default.
        cache_factory: builds the KV cache of each new sequence; default full KV on the device.
        kv_dtype: "auto" (see :func:`pick_kv_dtype`), "fp32", "bf16", "fp16": the KV cache's and attention's dtype.
        compile: decode steps run the layers' math through ``torch.compile`` (``--compile``; see
            :func:`zoomr.backends.torch.model.compiled_blocks`), compiled here at load (seconds to a minute on
            a CPU; inductor caches its kernels on disk for the next load).
    Raises:
        backends.torch.weights.ModelLoadError: unreadable weights.
        ValueError: bad device/dtype/quant, n_ctx < 1, tokenizer/model vocabulary mismatch.
    """

    name = "torch"

    def __init__(self, source: ModelSource, device: str = "auto", dtype: str = "auto", n_ctx: int = 4096,
                 threads: int | None = None, cache_factory: CacheFactory | None = None, quant: str = "auto",
                 kv_dtype: str = "auto", compile: bool = False):
        if n_ctx < 1:
            raise ValueError(f"-c must be >= 1, got {n_ctx}")
        check_quant(quant)
        if threads:
            torch.set_num_threads(threads)
        self.source = source
        self.device = pick_device(device)
        self.quant = resolve_quant(quant, source.kind, dtype)
        runs_here = {"fp16": fp16_gemm_available, "w8a8": w8a8_available}.get(self.quant)
        if runs_here is not None and not runs_here(self.device):
            raise ValueError(f"--quant {self.quant} runs an fbgemm GEMM on an x86 CPU, not on {self.device.type} "
                             "(use --quant int4 or none)")
        if self.quant == "ggml":
            check_ggml(source.kind, self.device)
            if compile:
                raise ValueError("--compile compiles torch's layer math, which --quant ggml runs in ggml: use one "
                                 "or the other")
        # --quant auto on a CPU with a GGUF file and --dtype auto: ggml's kernels or torch's int4, measured here
        # (--compile asks for torch's layer math: int4 then)
        self.quant_reason = ""
        if (quant == "auto" and self.quant == "auto" and dtype == "auto" and self.device.type == "cpu"
                and source.kind == "gguf" and not compile and ggml_available()):
            from .quant_probe import pick, reason

            self.quant, entry = pick(source.path, pick_dtype("auto", self.device, "int4"))
            self.quant_reason = f" (--quant auto → {'ggml' if self.quant == 'ggml' else 'int4'}: {reason(entry)})"
        kernel = {"none": "dense", "int8": "int8", "fp16": "fp16", "w8a8": "w8a8", "ggml": "ggml"}.get(self.quant, "int4")
        self.dtype = pick_dtype(dtype, self.device, kernel)
        if source.kind == "gguf":
            cfg, tensors, meta = load_gguf(source.path, keep_blocks=self.quant != "none", raw=self.quant == "ggml")
            self.tokenizer = LlamaCppTokenizer(source.path)
        else:
            cfg, tensors, meta = load_hf_dir(source.path)
            self.tokenizer = HFTokenizer(source.path)
        if self.tokenizer.vocab_size > cfg.vocab:
            raise ValueError(f"{source.path}: tokenizer has {self.tokenizer.vocab_size} ids, model {cfg.vocab}")
        self.cfg = cfg
        self.model = Decoder(cfg, tensors, self.device, self.dtype, quant=self.quant,
                             kv_dtype=pick_kv_dtype(kv_dtype, self.device, self.dtype), compile=compile)
        self.kv_dtype = self.model.kv_dtype
        del tensors
        self.n_ctx = n_ctx
        self.cache_factory = cache_factory or _full_cache
        self.policy_name = REFERENCE if cache_factory is None else getattr(cache_factory, "policy_name", "custom")
        if compile:
            self._compile_now()

    def _compile_now(self) -> None:
        # compiling at load keeps it out of the first decode's time (and out of its tok/s): one step at one row
        # compiles the static graphs, one at two rows the dynamic-row ones every later batch size reuses
        seqs = [TorchSequence(_full_cache(self)) for _ in range(2)]
        self.forward_batch(seqs, [[0, 0], [0]])
        self.forward_batch(seqs[:1], [[0]])
        self.forward_batch(seqs, [[0], [0]])

    def with_cache_factory(self, cache_factory: CacheFactory | None) -> "TorchBackend":
        """A view of this backend sharing weights and tokenizer whose new sequences use ``cache_factory``
        (None = full KV). Lets ``zoomr bench`` compare policies without reloading the model."""
        view = copy.copy(self)
        view.cache_factory = cache_factory or _full_cache
        view.policy_name = REFERENCE if cache_factory is None else getattr(cache_factory, "policy_name", "custom")
        return view

    @property
    def policy_spec(self) -> PolicySpec | None:
        """The KV policy new sequences run, with the knobs it was given (what :func:`zoomr.prompts.solve_system`
        reads to prompt for summaries): ``full`` for plain full KV, the cache factory's ``spec``
        (:class:`zoomr.kvstore.registry.PolicyCacheFactory`); None for a custom factory (no spec to read)."""
        if self.cache_factory is _full_cache:
            return PolicySpec(REFERENCE)
        return getattr(self.cache_factory, "spec", None)

    def shares_weights(self, other) -> bool:
        """True when ``other`` is a view of these weights (:meth:`with_cache_factory`) with the same context
        cap: sequences of both may then go through one :meth:`forward_batch`, each with its own cache."""
        return isinstance(other, TorchBackend) and other.model is self.model and other.n_ctx == self.n_ctx

    def describe(self) -> str:
        """One line: model, backend, device, dtype, weights, policy."""
        return f"{self.describe_model()} · KV policy {self.policy_name}"

    def describe_model(self) -> str:
        """:meth:`describe` without the policy, for a caller that runs several policies on these weights."""
        kv = "" if self.kv_dtype == self.dtype else f" · KV {str(self.kv_dtype).replace('torch.', '')}"
        # llama.cpp warns the same way: nothing breaks at once, but RoPE past its trained range extrapolates
        over = (f" · -c {self.n_ctx} is past the trained context of {self.cfg.max_ctx} positions (extrapolated)"
                if self.n_ctx > self.cfg.max_ctx else "")
        return (f"{self.source.name} · torch · {self.device.type} · {str(self.dtype).replace('torch.', '')}{kv}"
                f" · weights {self.model.weight_summary()}{self.quant_reason} · {self.cfg.n_layers} layers"
                f"{' · compiled decode' if self.model.compiled else ''}{over}")

    def new_sequence(self) -> TorchSequence:
        """An empty sequence with a fresh cache from the cache factory; a policy that scores with calibrated query
        statistics (TriAttention) gets this model's, calibrated on first use (:mod:`.calibrate`).

        Raises:
            StatsFileError: its statistics file is missing, corrupt or of another RoPE (a ValueError).
        """
        cache = self.cache_factory(self)
        bind_query_stats(self, cache)
        return TorchSequence(cache)

    def _forward(self, seq: TorchSequence, ids: list[int], all_logits: bool) -> np.ndarray:
        if not ids:
            raise ValueError("cannot run a forward over zero tokens")
        if len(seq.tokens) + len(ids) > self.n_ctx:
            raise ValueError(f"context full: {len(seq.tokens)} + {len(ids)} tokens exceed -c {self.n_ctx}")
        if min(ids) < 0 or max(ids) >= self.cfg.vocab:
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab})")
        start = seq.cache.n_tokens
        t_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device)
        logits = self.model.forward(t_ids, pos, seq.cache, all_logits=all_logits)
        seq.cache.end_forward(ids, self._text(seq, ids))
        seq.tokens.extend(ids)
        return logits.cpu().numpy()

    def _text(self, seq: TorchSequence, ids: list[int]) -> str:
        # only segment-tracking policies read the text: the others skip a detokenization per token
        return self.tokenizer.decode(ids) if getattr(seq.cache, "needs_text", True) else ""

    def prefill(self, seq: TorchSequence, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """See :meth:`zoomr.backends.base.Backend.prefill`. Raises ValueError when ``-c`` would be exceeded."""
        return self._forward(seq, list(ids), all_logits)

    def decode(self, seq: TorchSequence, token: int) -> np.ndarray:
        """See :meth:`zoomr.backends.base.Backend.decode`."""
        return self._forward(seq, [int(token)], False)

    def _check_batch(self, seqs: list[TorchSequence], ids_list: list[list[int]]) -> None:
        check_batch(seqs, ids_list)
        for i, (seq, ids) in enumerate(zip(seqs, ids_list)):
            if not ids:
                raise ValueError(f"batch row {i}: cannot run a forward over zero tokens")
            if len(seq.tokens) + len(ids) > self.n_ctx:
                raise ValueError(f"batch row {i}: context full: {len(seq.tokens)} + {len(ids)} tokens exceed "
                                 f"-c {self.n_ctx}")
            if min(ids) < 0 or max(ids) >= self.cfg.vocab:
                raise ValueError(f"batch row {i}: token id outside the vocabulary [0, {self.cfg.vocab})")

    def forward_batch(self, seqs: list[TorchSequence], ids_list: list[list[int]], all_logits: bool = False,
                      attention: str = "auto") -> torch.Tensor:
        """Append ``ids_list[b]`` to ``seqs[b]`` for every b in one forward; logits stay on the device.

        Every sequence keeps its own cache and policy (see :meth:`Decoder.forward_batch`); after the
        forward each cache's ``end_forward`` runs with its own tokens and text, in batch order.

        Args:
            seqs: B ≥ 1 distinct sequences.
            ids_list: B id lists, each ≥ 1 token (lengths may differ).
            all_logits: return every position's logits (rows of sequence b are consecutive, in order).
            attention: see :meth:`Decoder.forward_batch`.
        Returns:
            float32 torch tensor on the backend's device: [B, vocab], each sequence's next-token logits,
            or [Σ T_b, vocab] with ``all_logits``.
        Raises:
            ValueError: empty batch, lengths that differ, a repeated sequence, an empty id list, an id
                outside the vocabulary, ``-c`` exceeded (checked for every row before anything runs, so
                no sequence advances). An error inside a cache's update leaves the batch's caches
                partly written, as for a single forward.
        """
        ids_list = [[int(t) for t in ids] for ids in ids_list]
        self._check_batch(seqs, ids_list)
        flat = [t for ids in ids_list for t in ids]
        pos = [p for seq, ids in zip(seqs, ids_list) for p in range(seq.cache.n_tokens, seq.cache.n_tokens + len(ids))]
        t_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        t_pos = torch.tensor(pos, dtype=torch.long, device=self.device)
        logits = self.model.forward_batch(t_ids, t_pos, [len(ids) for ids in ids_list], [s.cache for s in seqs],
                                          all_logits=all_logits, attention=attention)
        for seq, ids in zip(seqs, ids_list):
            seq.cache.end_forward(ids, self._text(seq, ids))
            seq.tokens.extend(ids)
        return logits

    def prefill_batch(self, seqs: list[TorchSequence], ids_list: list[list[int]],
                      all_logits: bool = False) -> np.ndarray | list[np.ndarray]:
        """Prefill several prompts (ragged lengths) in one forward.

        Returns:
            float32 numpy [B, vocab], each sequence's last-position logits; with ``all_logits`` a list
            of B arrays [T_b, vocab].
        Raises:
            ValueError: see :meth:`forward_batch`.
        """
        out = self.forward_batch(seqs, ids_list, all_logits).cpu().numpy()
        if not all_logits:
            return out
        cuts = np.cumsum([len(ids) for ids in ids_list])[:-1]
        return np.split(out, cuts)

    def decode_batch(self, seqs: list[TorchSequence], tokens: list[int], on_device: bool = False
                     ) -> np.ndarray | torch.Tensor:
        """One token for each of B sequences in one forward.

        Args:
            seqs: B ≥ 1 distinct sequences (caches of any length, any policy).
            tokens: B ids; ``tokens[b]`` is appended to ``seqs[b]``.
            on_device: keep the logits on the device as a torch tensor (sample them there with
                :func:`zoomr.backends.sampling.sample_batch`; only ids then cross to the host).
        Returns:
            float32 [B, vocab]: numpy, or a torch tensor on the backend's device with ``on_device``.
        Raises:
            ValueError: see :meth:`forward_batch`.
        """
        if len(seqs) != len(tokens):
            raise ValueError(f"a batch needs one token per sequence, got {len(seqs)} sequences and "
                             f"{len(tokens)} tokens")
        logits = self.forward_batch(seqs, [[t] for t in tokens])
        return logits if on_device else logits.cpu().numpy()

    def fork(self, seq: TorchSequence) -> TorchSequence:
        """A copy of ``seq`` whose cache is cloned; no token is recomputed."""
        return TorchSequence(seq.cache.fork(), list(seq.tokens))

    def scoring_fork(self, seq: TorchSequence) -> TorchSequence:
        """A fork of ``seq`` for one teacher-forced forward (``prefill``/``prefill_batch`` with the tokens to
        score) that keeps none of its new K/V when the cache can do so (full KV:
        :class:`zoomr.kvstore.base.ScoringKVCache`); other caches fork as :meth:`fork` does."""
        make = getattr(seq.cache, "scoring_fork", None)
        return TorchSequence(make() if make is not None else seq.cache.fork(), list(seq.tokens))

    def free(self, seq: TorchSequence) -> None:
        """Drop the cache tensors of ``seq``; it is left holding an empty full-KV cache (no policy state), so
        freeing never builds a policy."""
        seq.cache = _full_cache(self)
        seq.tokens = []

    def kv_stats(self, seq: TorchSequence) -> KVStats:
        """The cache's own accounting."""
        return seq.cache.stats()


def default_threads() -> int:
    """Threads used when ``-t`` is not given: all cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
