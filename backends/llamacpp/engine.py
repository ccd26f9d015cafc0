"""The llama.cpp backend: llama-cpp-python's low-level API behind :class:`zoomr.backends.base.Backend`.

One llama.cpp context serves every sequence; a zoomr sequence is a llama.cpp sequence id, and a
fork is ``llama_memory_seq_cp`` (the prefix is never decoded again). How the KV cache is laid out
depends on whether the policy evicts, because of one llama.cpp fact: in a *unified* cache
(``kv_unified = True``) a fork shares the parent's cells, and ``llama_memory_seq_add`` on a shared
cell moves it for every sequence holding it (measured: shifting a fork's positions moved its
parent's last position from 30 to 19). So:

- ``full`` (never evicts, never shifts): unified cache. A fork tags the parent's cells with the
  child's id: no data copied, memory shared by every candidate.
- evicting policies: one stream per sequence id (``kv_unified = False``), ``max_sequences`` streams
  of at least the policy's cap. A fork copies the parent's whole stream (llama.cpp does it at the
  next decode), which is cheap because a budgeted stream is small (the policy's cap, padded by
  llama.cpp to 256 cells), and it makes every cell private, so shifting is safe. Measured per fork
  on the embedded model, 1 CPU thread (``python benchmarks/llamacpp_speed.py``): unified ≈ 0.1-1.8
  ms, a 256-cell stream 3.6 ms, a 2304-cell stream 12 ms, against a 19-75 ms decode step.

Position handling after eviction, streaming: positions are kept *compact*. When it removes positions
``[a, b)`` with ``llama_memory_seq_rm``, the later cells are shifted down by ``b - a`` with
``llama_memory_seq_add`` (llama.cpp re-rotates the cached keys: its context shift). So a sequence
holding n cells always occupies positions ``0 … n-1``, ``tokens[i]`` sits at position ``i``,
positions never exceed the policy's cap (≤ ``-c``; so never the model's trained context when ``-c``
fits it), and streaming generates for as long as asked, far past ``-c``. This is
StreamingLLM's original scheme (positions counted inside the cache), not the keep-original-positions
simplification the torch backend uses; the two backends' streaming runs differ in positions. The
score-ranked policies (``shifts = False``, :mod:`zoomr.backends.llamacpp.scored`) and sumr
(:mod:`zoomr.backends.llamacpp.sumr`) keep original positions instead, as on the torch backend: their
evictions leave holes, and the next token goes at ``n_written``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np

from zoomr.backends.base import BackendError, KVMeter, KVStats, check_batch
from zoomr.backends.memory import host_available_bytes
from zoomr.backends.models import ModelSource
from zoomr.backends.tokenizer import LlamaCppTokenizer
from zoomr.kvstore.events import EventBus
from zoomr.kvstore.registry import REFERENCE, PolicySpec

from .amx_probe import known_verdict
from .batch import Batch
from .policies import STREAMING_BUFFER, make_policy
from .runtime import GGML_TYPE_F16, decode_error, gpu_offload_supported, load_model, model_info, new_context
from .sequence import LlamaCppSequence, cells_held, position_ranges, remove_positions

FORK_ROOM = 512  # cells reserved per extra sequence id: one KV-Rescue step (≤ 512 tokens) per candidate
DEFAULT_SEQUENCES = 8  # the parent + 7 candidates (KV-Rescue forks N_b base candidates per step)
STREAM_POOL = 8192  # most cells the automatic sizing spends on private streams (sumr with a large -c)


def size_cache(cap: int, evicts: bool, max_sequences: int | None, kv_cells: int | None) -> tuple[int, int]:
    """(sequence ids, KV cells) of the context, see :class:`LlamaCppBackend` (tokens).

    Raises:
        ValueError: kv_cells too small for ``cap`` cells per sequence.
    """
    if max_sequences is None:
        # private streams cost cap cells per id up front: fewer ids when cap is large
        max_sequences = DEFAULT_SEQUENCES if not evicts else max(1, min(DEFAULT_SEQUENCES, STREAM_POOL // cap))
    need = cap * max_sequences if evicts else cap
    if kv_cells is None:
        kv_cells = need if evicts else cap + (max_sequences - 1) * min(cap, FORK_ROOM)
    if kv_cells < need:
        raise ValueError(f"kv_cells {kv_cells} cannot hold {cap} cells per sequence")
    return max_sequences, kv_cells


def check_kv_fits(kv_cells: int, bytes_per_cell: int, cap: int, on_gpu: bool) -> None:
    """Refuse a KV cache that cannot fit in the host memory free now, before llama.cpp tries to allocate it.

    Args:
        kv_cells: the context's KV cells (tokens); bytes_per_cell: K and V of one cell over all layers (bytes);
        cap: ``-c``, for the message (tokens); on_gpu: the cells go to a GPU (not checked: llama.cpp says so).
    Raises:
        ValueError: ``-c`` whose cache needs more bytes than the host has available (numbers named).
    """
    free = None if on_gpu else host_available_bytes()
    need = kv_cells * bytes_per_cell
    if free is not None and need > free:
        raise ValueError(f"-c {cap}: llama.cpp's KV cache of {kv_cells} cells needs {need / 2**30:.1f} GiB, more "
                         f"than the {free / 2**30:.1f} GiB of memory free; use a smaller -c")


def cache_words(kv_cells: int, max_sequences: int, unified: bool) -> str:
    """The KV cache of :meth:`LlamaCppBackend.describe` in plain words: cells (one token's K and V each) and
    the room kept for forks (the candidates KV-Rescue forks from the sequence), in one pool or one stream each."""
    size, n = f"KV cache {kv_cells} cells (tokens)", max_sequences - 1
    if not n:
        return f"{size}, no room for forks"
    forks = "1 fork" if n == 1 else f"{n} forks"
    if unified:
        return f"{size}, shared with up to {forks} (KV-Rescue candidates)"
    return (f"{size}: {kv_cells // max_sequences} for the sequence and for each of up to {forks} "
            "(KV-Rescue candidates)")


def _all_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LlamaCppBackend:
    """A GGUF model in llama.cpp with zoomr's KV budgets (eviction) and forks.

    Args:
        source: resolved model; must be a GGUF file.
        n_ctx: most cells one sequence may hold (``-c``, tokens). An evicting policy's cap must fit in
            it (streaming: sink + window + buffer); it then generates without limit.
        threads: CPU threads for decode and prefill (``-t``); None = all cores of this process.
        n_gpu_layers: layers offloaded to the GPU (``-ngl``, -1 = all); no effect on a CPU build.
        policy: KV policy, one the registry (:mod:`zoomr.kvstore.registry`) lists for llamacpp
            (``full``, ``streaming``, ``h2o``, ``snapkv``, ``rkv``, ``keydiff``, ``sumr``); see
            :mod:`zoomr.backends.llamacpp.policies`.
        buffer: streaming's eviction buffer (tokens).
        knobs: the policy's knobs (``budget=64, sink=4, window=None`` for streaming; ``window``,
            ``summaries`` for sumr); those not given keep the policy's defaults.
        max_sequences: llama.cpp sequence ids (``n_seq_max``): the parent plus the forks alive at
            once; a fork beyond it raises :class:`BackendError`. None: 8, or under an evicting policy
            as many as fit 8192 cells of private streams (at least 1).
        kv_cells: KV cells of the context (tokens). ``full`` (unified cache shared by all sequences):
            default ``cap + (max_sequences - 1) * min(cap, 512)``, room for every fork to write one
            rescue step of ≤ 512 tokens beside the parent; more makes llama_decode report no KV
            slot (BackendError). Evicting policies (one stream per sequence): default
            ``cap * max_sequences``. cap is the policy's per-sequence limit (sink + window + buffer
            for streaming, -c otherwise); llama.cpp rounds up to multiples of 256 (per stream).
        n_batch: most tokens per ``llama_decode`` (prefill chunks; candidates per batched step).
    Raises:
        ValueError: not a GGUF file, an unsupported or ill-fitting policy, bad sizes, a model whose
            KV cannot be shifted or partly removed while the policy evicts, a model whose graph does not
            name its rotated queries and keys ``Qcur-*``/``Kcur-*`` under a score-ranked policy.
        BackendError: llama.cpp cannot create the context.
    Attributes:
        tokens_submitted: tokens handed to ``llama_decode`` so far (all sequences; tokens).
        decode_calls: ``llama_decode`` calls so far.
        kv_events: the policy's recompute events (sumr), for live displays.
        policy_spec: the policy and the knobs given (:class:`zoomr.kvstore.registry.PolicySpec`; what
            :func:`zoomr.prompts.solve_system` reads to prompt for summaries).
    """

    name = "llamacpp"

    def __init__(self, source: ModelSource, n_ctx: int = 4096, threads: int | None = None,
                 n_gpu_layers: int = -1, policy: str = REFERENCE, *, buffer: int = STREAMING_BUFFER,
                 max_sequences: int | None = None, kv_cells: int | None = None, n_batch: int = 512, **knobs):
        import llama_cpp

        self._model = self._ctx = self._batch = None  # for close() on any early exit
        if source.kind != "gguf":
            raise ValueError(f"{source.path}: the llamacpp backend needs a GGUF file (use --backend torch for "
                             "HF directories)")
        if n_ctx < 1:
            raise ValueError(f"-c must be >= 1, got {n_ctx}")
        if threads is not None and threads < 1:
            raise ValueError(f"-t must be >= 1, got {threads}")
        self.kv_events = EventBus()
        self._new_policy = make_policy(policy, n_ctx, buffer=buffer, events=self.kv_events, **knobs)
        self.policy_name = policy
        self.policy_spec = PolicySpec(policy, **knobs)
        first = self._new_policy()
        cap = first.cap
        # TriAttention's query statistics (calibrated by the torch backend on the same file when none are cached),
        # read before this model loads, so a calibration's own copy of the weights is gone by then
        self.query_stats = None
        if getattr(first, "needs_query_stats", False):
            from zoomr.backends.torch.calibrate import gguf_query_stats

            self.query_stats = gguf_query_stats(source, knobs.get("stats_file"))[0]
        self.keeps_store = getattr(first, "keeps_store", False)
        # see the module docstring; a store and its active sequence share cells, so they need one pool
        self.unified = not first.evicts or self.keeps_store
        if self.keeps_store:   # one sequence (store + active ids), every position in the pool
            max_sequences, kv_cells = max_sequences or 2, kv_cells or cap
        max_sequences, kv_cells = size_cache(cap, not self.unified, max_sequences, kv_cells)
        if not 1 <= max_sequences <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(f"max_sequences must be in [1, {llama_cpp.llama_max_parallel_sequences()}], "
                             f"got {max_sequences}")
        if n_batch < max_sequences:
            raise ValueError(f"n_batch {n_batch} must hold one row per sequence ({max_sequences})")

        self.source, self.n_ctx, self.max_sequences = source, n_ctx, max_sequences
        self.n_gpu_layers = n_gpu_layers
        self.threads = threads or _all_cores()
        try:
            self._load(kv_cells, n_batch, cap)
        except Exception:
            self.close()
            raise
        self._free_ids = list(range(max_sequences - 1, -1, -1))
        self._abort_cb = None
        self._bytes_per_token = self.info.kv_bytes_per_token(GGML_TYPE_F16)
        self.tokens_submitted = 0
        self.decode_calls = 0
        if self.capture is not None:
            try:
                self._check_capture()
            except Exception:
                self.close()
                raise
            self.tokens_submitted = self.decode_calls = 0

    def _load(self, kv_cells: int, n_batch: int, cap: int) -> None:
        """Model, tokenizer, context and batch; checks the model can do what the policy asks."""
        import llama_cpp

        self._model = load_model(self.source.path, self.n_gpu_layers)
        self.info = model_info(self._model)
        policy = self._new_policy()
        if policy.evicts and (llama_cpp.llama_model_is_recurrent(self._model)
                       or llama_cpp.llama_model_is_hybrid(self._model)):
            raise ValueError(f"--policy {self.policy_name} removes KV cells, which this recurrent/hybrid model "
                             "cannot do")
        check_kv_fits(kv_cells, self.info.kv_bytes_per_token(GGML_TYPE_F16), cap,
                      on_gpu=self.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload())
        self.tokenizer = LlamaCppTokenizer(self.source.path)
        if self.tokenizer.vocab_size > self.info.n_vocab:
            raise ValueError(f"{self.source.path}: tokenizer has {self.tokenizer.vocab_size} ids, "
                             f"model {self.info.n_vocab}")
        self.capture = None
        if policy.wants_kq:   # score-ranked policies and zoomr read each forward's queries and keys
            from .capture import KQCapture
            from .scored import Shapes

            self.shapes = Shapes(self.info.n_layer, llama_cpp.llama_model_n_head(self._model), self.info.n_head_kv,
                                 self.info.head_dim_k)
            self.capture = KQCapture(*dataclasses.astuple(self.shapes))
        if self.query_stats is not None:   # where llama.cpp puts each RoPE pair of this model's keys
            from .triattention_cells import rope_style

            self.rope_style = rope_style(self._model)
        self._ctx, self._mem = new_context(self._model, kv_cells, n_batch, self.max_sequences, self.unified,
                                           self.threads, self.capture.callback if self.capture else None)
        if policy.evicts and policy.shifts and not llama_cpp.llama_memory_can_shift(self._mem):
            raise ValueError(f"--policy {self.policy_name} shifts KV positions, which llama.cpp cannot do for this "
                             "model")
        self.kv_cells = llama_cpp.llama_n_ctx(self._ctx)
        # where llama.cpp keeps the KV cells: on the GPU only when layers are offloaded to one
        self.kv_device = "cuda" if self.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload() else "cpu"
        if llama_cpp.llama_n_ctx_seq(self._ctx) < cap:  # llama.cpp pads, so only a changed rule could trip this
            raise BackendError(f"llama.cpp gave each sequence fewer than the {cap} cells the policy needs")
        self._batch = Batch(n_batch)

    def _check_capture(self) -> None:
        """One token through the graph, so a model whose graph names its queries and keys otherwise is refused
        here, before any sequence runs.

        Raises:
            ValueError: naming the policy and the backend.
        """
        from .capture import GraphNamesError

        seq = self.new_sequence()
        try:
            self.prefill(seq, [0])
        except GraphNamesError as e:
            raise ValueError(f"--policy {self.policy_name} on --backend llamacpp needs the rotated queries and keys "
                             f"of every layer, which this model's llama.cpp graph does not name as expected ({e}); "
                             "use --backend torch") from None
        finally:
            self.free(seq)

    # --- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the batch, context and model (idempotent); the backend is unusable afterwards."""
        import llama_cpp

        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown may already have unloaded llama_cpp
            pass

    def describe(self) -> str:
        """One line: model, backend, device, KV type, layers, policy, and the KV cells in plain words."""
        device = f"gpu (-ngl {self.n_gpu_layers})" if gpu_offload_supported() and self.n_gpu_layers else "cpu"
        policy = self._new_policy().describe()
        cache = (f"KV cache {self.kv_cells} cells (tokens), every position kept in a store sequence: the selection "
                 "saves attention, not KV memory" if self.keeps_store
                 else cache_words(self.kv_cells, self.max_sequences, self.unified))
        # a user comparing speeds should know llama.cpp runs without its AMX/repacked layouts here
        layouts = " · llama.cpp's AMX layouts off (they fault on this machine)" if known_verdict() is False else ""
        return (f"{self.source.name} · llamacpp · {device} · {self.threads} threads · KV f16 · {self.info.n_layer} "
                f"layers · KV policy {policy} · {cache}{layouts}")

    def set_abort(self, should_abort: Callable[[], bool] | None) -> None:
        """Install a check llama.cpp calls during ``llama_decode``; True aborts it (BackendError).

        Python runs once per graph node while installed (slows decoding); None removes it.
        """
        import llama_cpp

        if should_abort is None:
            self._abort_cb = None
            llama_cpp.llama_set_abort_callback(self._ctx, llama_cpp.ggml_abort_callback(), None)
            return
        self._abort_cb = llama_cpp.ggml_abort_callback(lambda _data: bool(should_abort()))
        llama_cpp.llama_set_abort_callback(self._ctx, self._abort_cb, None)

    # --- sequences -------------------------------------------------------------------------------

    def new_sequence(self) -> LlamaCppSequence:
        """An empty sequence on a free sequence id.

        Raises:
            BackendError: all ``max_sequences`` ids are in use.
        """
        policy = self._new_policy()
        if policy.wants_kq:
            policy.bind(self.shapes)
        if self.query_stats is not None:
            policy.use_query_stats(self.query_stats, self.rope_style)
        seq = LlamaCppSequence(self._take_id(), policy)
        if self.keeps_store:
            try:
                seq.store_id = self._take_id()
            except BackendError:
                self._free_ids.append(seq.seq_id)
                raise
        return seq

    def _take_id(self) -> int:
        if not self._free_ids:
            raise BackendError(f"all {self.max_sequences} llama.cpp sequence ids are in use: free a sequence, or "
                               "build the backend with a larger max_sequences")
        return self._free_ids.pop()

    def fork(self, seq: LlamaCppSequence) -> LlamaCppSequence:
        """A child holding ``seq``'s KV (``llama_memory_seq_cp``); nothing is decoded again.

        Unified cache (``full``): the cells are shared, no data copied. Streams (evicting policies):
        llama.cpp copies the parent's stream into the child's at the next decode.

        Raises:
            BackendError: no free sequence id.
            ValueError: ``seq`` was freed.
        """
        import llama_cpp

        self._check_live(seq)
        forked = seq.policy.fork()   # zoomr refuses (ValueError) before an id is taken
        child = LlamaCppSequence(self._take_id(), forked, list(seq.tokens), list(seq.origin),
                                 seq.n_written, len(seq.tokens), len(seq.tokens),
                                 meter=seq.meter.copy() if seq.meter else None, forwards=seq.forwards)
        llama_cpp.llama_memory_seq_cp(self._mem, seq.seq_id, child.seq_id, -1, -1)
        return child

    def free(self, seq: LlamaCppSequence) -> None:
        """Remove the sequence's cells (``llama_memory_seq_rm`` over all positions) and release its id.

        Cells shared with other sequences stay for them. Freeing twice is a no-op.
        """
        import llama_cpp

        if seq.seq_id < 0:
            return
        for sid in (seq.seq_id, seq.store_id):
            if sid >= 0:
                llama_cpp.llama_memory_seq_rm(self._mem, sid, -1, -1)
                self._free_ids.append(sid)
        seq.seq_id = seq.store_id = -1
        seq.tokens, seq.origin = [], []

    def _check_live(self, seq: LlamaCppSequence) -> None:
        if seq.seq_id < 0:
            raise ValueError("this sequence was freed")

    # --- forwards --------------------------------------------------------------------------------

    def prefill(self, seq: LlamaCppSequence, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Append ``ids`` (T ≥ 1 tokens); logits of the last position [vocab], or of all [T, vocab].

        Runs in chunks of at most ``n_batch`` tokens, and, under an evicting policy, of at most the
        room left before the policy's cap, evicting between chunks, so a prompt longer than the
        budget never occupies more than the cap.

        Raises:
            ValueError: empty ``ids``, ids outside the vocabulary, a full context (policy ``full``).
            BackendError: llama_decode failed (the sequence is left as before the failing chunk).
        """
        ids = [int(t) for t in ids]
        self._check_live(seq)
        self._check_ids(ids)
        self._check_room(seq, len(ids))
        rows = []
        done, start = 0, seq.n_written
        chunked = seq.policy.wants_kq and getattr(seq.policy, "observes_chunks", True)
        while done < len(ids):
            self._make_room(seq)
            n = min(len(ids) - done, seq.policy.cap - len(seq.tokens), self._batch.capacity)
            chunk = ids[done:done + n]
            self._batch.set_run(chunk, seq.next_position, seq.seq_id, all_logits)
            self._run([seq])
            rows.extend(self._logits(i) for i in (range(n) if all_logits else [n - 1]))
            if seq.policy.wants_kq:
                seq.policy.take_kq(*self._kq_rows(0, n))
            self._appended(seq, chunk)
            if chunked:   # each chunk scored (and cut) before the next
                self._observed(seq, seq.n_written - n, chunk)
            done += n
        if not chunked:
            self._observed(seq, start, ids)
        return np.stack(rows) if all_logits else rows[-1]

    def decode(self, seq: LlamaCppSequence, token: int) -> np.ndarray:
        """Append one token; next-token logits, shape [vocab] (float32).

        Raises:
            ValueError: id outside the vocabulary, a full context (policy ``full``), a freed sequence.
            BackendError: llama_decode failed.
        """
        return self.prefill(seq, [token])

    def decode_batch(self, seqs: list[LlamaCppSequence], tokens: list[int], on_device: bool = False) -> np.ndarray:
        """One token for each of several sequences in a single ``llama_decode`` (a step of N candidates).

        Args:
            seqs: N distinct live sequences.
            tokens: N ids, ``tokens[i]`` appended to ``seqs[i]``.
            on_device: accepted for the torch backend's signature; llama.cpp's logits are read on the host.
        Returns:
            float32 logits [N, vocab]; row i is ``seqs[i]``'s next-token distribution.
        Raises:
            ValueError: empty batch, lengths differ, a sequence repeats or was freed, N > n_batch, bad
                ids, a full context.
            BackendError: llama_decode failed (no sequence advanced).
        """
        tokens = [int(t) for t in tokens]
        if not seqs:
            raise ValueError("a batch needs at least one sequence")
        if len(seqs) != len(tokens):
            raise ValueError(f"a batch needs one token per sequence, got {len(seqs)} sequences and "
                             f"{len(tokens)} tokens")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("a sequence appears twice in one batch")
        if len(seqs) > self._batch.capacity:
            raise ValueError(f"a batch of {len(seqs)} sequences exceeds n_batch {self._batch.capacity}")
        for s in seqs:
            self._check_live(s)
            self._check_room(s, 1)
        self._check_ids(tokens)
        for s in seqs:
            self._make_room(s)
        self._batch.set_rows(tokens, [s.next_position for s in seqs], [s.seq_id for s in seqs])
        self._run(seqs)
        out = np.stack([self._logits(i) for i in range(len(seqs))])
        for i, s in enumerate(seqs):
            if s.policy.wants_kq:
                s.policy.take_kq(*self._kq_rows(i, i + 1))
        for s, t in zip(seqs, tokens):
            self._appended(s, [t])
            self._observed(s, s.n_written - 1, [t])
        return out

    decode_many = decode_batch  # its earlier name, kept for callers written before the batched interface

    def prefill_batch(self, seqs: list[LlamaCppSequence], ids_list: list[list[int]],
                      all_logits: bool = False) -> np.ndarray | list[np.ndarray]:
        """Prefill several sequences (ragged lengths) in one ``llama_decode`` when they fit in it.

        One decode when the rows fit ``n_batch`` and no sequence would reach its policy's cap (no
        eviction is due mid-prompt); otherwise each sequence runs :meth:`prefill` in turn (same result).

        Returns:
            float32 [B, vocab], each sequence's last-position logits; with ``all_logits`` a list of B
            arrays [T_b, vocab].
        Raises:
            ValueError: empty batch, lengths that differ, a repeated or freed sequence, an empty id list,
                ids outside the vocabulary, a full context (policy ``full``): checked before anything runs.
            BackendError: llama_decode failed (no sequence advanced).
        """
        ids_list = [[int(t) for t in ids] for ids in ids_list]
        check_batch(seqs, ids_list)
        for s, ids in zip(seqs, ids_list):
            self._check_live(s)
            self._check_ids(ids)
            self._check_room(s, len(ids))
        fits = sum(map(len, ids_list)) <= self._batch.capacity and all(
            len(s.tokens) + len(ids) < s.policy.cap for s, ids in zip(seqs, ids_list))
        if not fits:
            rows = [self.prefill(s, ids, all_logits) for s, ids in zip(seqs, ids_list)]
            return rows if all_logits else np.stack(rows)
        starts = self._batch.set_runs([(ids, s.next_position, s.seq_id) for s, ids in zip(seqs, ids_list)],
                                      all_logits)
        self._run(seqs)
        rows = []
        for s, ids, i0 in zip(seqs, ids_list, starts):
            picks = range(i0, i0 + len(ids)) if all_logits else [i0 + len(ids) - 1]
            rows.append(np.stack([self._logits(i) for i in picks]) if all_logits else self._logits(picks[0]))
        for s, ids, i0 in zip(seqs, ids_list, starts):
            if s.policy.wants_kq:
                s.policy.take_kq(*self._kq_rows(i0, i0 + len(ids)))
            start = s.n_written
            self._appended(s, ids)
            self._observed(s, start, ids)
        return rows if all_logits else np.stack(rows)

    def _check_room(self, seq: LlamaCppSequence, n: int) -> None:
        """Refuse ``n`` more tokens past ``-c``: cells under full KV; positions under a policy that leaves holes,
        whose positions (and so rotations) keep counting past what it evicted, as on the torch backend, so
        ``-c`` bounds the generation's length on both. A shifting policy (streaming) never runs out.

        Raises:
            ValueError: ``context full: …`` (nothing has run).
        """
        if not seq.policy.evicts:
            used, limit = len(seq.tokens), seq.policy.cap
        elif not seq.policy.shifts:
            used, limit = seq.n_written, self.n_ctx
        else:
            return
        if used + n > limit:
            raise ValueError(f"context full: {used} + {n} tokens exceed -c {self.n_ctx}")

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("cannot run a forward over zero tokens")
        if min(ids) < 0 or max(ids) >= self.info.n_vocab:
            raise ValueError(f"token id outside the vocabulary [0, {self.info.n_vocab})")

    def _run(self, seqs: list[LlamaCppSequence]) -> None:
        """``llama_decode`` of the filled batch; on failure roll every sequence back to its tokens."""
        import llama_cpp

        n = self._batch.n_tokens
        self.tokens_submitted += n
        self.decode_calls += 1
        if self.capture is not None:
            self.capture.begin()
        rc = llama_cpp.llama_decode(self._ctx, self._batch.raw)
        if rc != 0:
            # after an abort or a fatal error, the ubatches already computed stay in the cache
            for s in seqs:
                llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, s.next_position, -1)
            raise decode_error(rc, n, self.kv_cells)
        if self.capture is not None:
            try:
                self._kq = self.capture.take(n)
            except Exception:
                for s in seqs:
                    llama_cpp.llama_memory_seq_rm(self._mem, s.seq_id, s.next_position, -1)
                raise

    def _kq_rows(self, i0: int, i1: int):
        """Rows ``[i0, i1)`` of the last decode's captured queries and keys, per layer."""
        q, k = self._kq
        return [x[i0:i1] for x in q], [x[i0:i1] for x in k]

    def _logits(self, row: int) -> np.ndarray:
        import ctypes

        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        if not ptr:
            raise BackendError(f"llama.cpp returned no logits for batch row {row}")
        out = np.empty(self.info.n_vocab, dtype=np.float32)
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)  # measured 20 vs 170 µs for as_array(...).copy()
        return out

    def _appended(self, seq: LlamaCppSequence, ids: list[int]) -> None:
        """Record tokens llama.cpp now holds, and check its cell count agrees with ours."""
        if seq.store_id >= 0:
            import llama_cpp

            # into the store after the forward: a batch row tagged with both ids would attend both ids' cells
            llama_cpp.llama_memory_seq_cp(self._mem, seq.seq_id, seq.store_id, seq.n_written, seq.n_written + len(ids))
        seq.tokens.extend(ids)
        seq.origin.extend(range(seq.n_written, seq.n_written + len(ids)))
        seq.n_written += len(ids)
        seq.peak = max(seq.peak, len(seq.tokens))
        cells = self.cells_held(seq)
        # with holes llama.cpp's count is the span of positions, checked here; the cells are ours
        seq.peak_cells_llama = max(seq.peak_cells_llama, cells if seq.policy.shifts else len(seq.tokens))
        if cells != (len(seq.tokens) if seq.policy.shifts else seq.n_written - seq.origin[0]):
            raise BackendError(f"llama.cpp holds {cells} cells for sequence {seq.seq_id}, zoomr expected "
                               f"{len(seq.tokens)} (KV bookkeeping out of step)")

    def _observed(self, seq: LlamaCppSequence, start: int, ids: list[int]) -> None:
        """After a prefill/decode call: count the cells it attended, tell the policy, and evict if it asks or
        the sequence is at its cap (so between calls an evicting policy holds fewer than cap cells
        whenever it can, and a caller checking ``len(seq.tokens)`` against ``-c`` sees room)."""
        if seq.meter is None:
            bound = getattr(seq.policy, "bound", seq.policy.cap) if seq.policy.evicts else None
            seq.meter = KVMeter(self._bytes_per_token, bound, self.kv_device)
        b = self._bytes_per_token
        seq.meter.step(len(seq.tokens), len(seq.tokens) * b, seq.n_written, seq.forwards == 0,
                       device_bytes=self.kv_cells * b, state_bytes=seq.policy.state_bytes())
        seq.forwards += 1
        text = self.tokenizer.decode(ids) if seq.policy.wants_text else ""
        if seq.policy.wants_kq:   # torch scores the forward: on one thread, beside llama.cpp's
            from .scored import one_torch_thread

            with one_torch_thread():
                changed = seq.policy.observe(start, ids, text)
        else:
            changed = seq.policy.observe(start, ids, text)
        if seq.meter.bound is not None:   # R-KV's bound grows with the prompt, known once it was observed
            seq.meter.bound = getattr(seq.policy, "bound", seq.policy.cap)
        if changed and seq.store_id >= 0:
            self._reselect(seq, seq.policy.selection())
        elif changed or (seq.policy.evicts and len(seq.tokens) >= seq.policy.cap):
            remove_positions(self._mem, seq, seq.policy.evict(list(seq.origin)))

    def _reselect(self, seq: LlamaCppSequence, keep: list[int]) -> None:
        """Make ``seq``'s active cells exactly ``keep`` (ascending absolute positions): ``seq_rm`` the ones
        leaving, ``seq_cp`` from the store the ones coming back (no data copied: the pool is unified)."""
        import llama_cpp

        kept = set(keep)
        remove_positions(self._mem, seq, position_ranges([p for p in seq.origin if p not in kept]))
        held = set(seq.origin)
        back = [p for p in keep if p not in held]
        for p0, p1 in position_ranges(back):
            llama_cpp.llama_memory_seq_cp(self._mem, seq.store_id, seq.seq_id, p0, p1)
        if back:
            seq.origin = sorted(held | set(back))
            seq.tokens = [seq.policy.written[p] for p in seq.origin]
            seq.policy.restored += len(back)

    def cells_held(self, seq: LlamaCppSequence) -> int:
        """KV cells llama.cpp holds for ``seq`` (see :func:`zoomr.backends.llamacpp.sequence.cells_held`)."""
        return cells_held(self._mem, seq.seq_id)

    # --- eviction --------------------------------------------------------------------------------

    def _make_room(self, seq: LlamaCppSequence) -> None:
        """Ensure one free cell under the policy's cap, evicting if the sequence is at it.

        Raises:
            ValueError: the policy may evict nothing (a full context).
        """
        if len(seq.tokens) < seq.policy.cap:
            return
        remove_positions(self._mem, seq, seq.policy.evict(list(seq.origin)))
        if len(seq.tokens) >= seq.policy.cap:
            raise ValueError(f"context full: the sequence holds {len(seq.tokens)} tokens, the most -c {self.n_ctx} "
                             f"and KV policy {seq.policy.name} allow")

    # --- accounting ------------------------------------------------------------------------------

    def kv_stats(self, seq: LlamaCppSequence) -> KVStats:
        """KV accounting: active = cells the sequence holds now, full = positions ever written.

        Bytes are f16 K and V over all layers: ``2 * n_layer * n_head_kv * head_dim * 2`` per token
        (for the embedded model 23,040 B). ``device_kv_bytes`` is the KV buffer llama.cpp allocated
        for the whole context (``kv_cells`` cells, shared by its sequences): llama.cpp reserves it up
        front, whatever a policy evicts. ``bound_tokens`` is the policy's cell cap. ``extra`` adds
        llama.cpp's own count of the cells now and at the peak and the eviction counters; under an
        evicting policy also ``policy`` and the policy's counters, the keys the torch backend's
        policies report.
        """
        b = self._bytes_per_token
        # with holes (a policy that keeps positions) llama.cpp's span is not a count: zoomr's is reported
        held = (self.cells_held(seq) if seq.policy.shifts else len(seq.tokens)) if seq.seq_id >= 0 else 0
        extra = {"llama_cells": held, "llama_peak_cells": seq.peak_cells_llama,
                 "evictions": seq.evictions, "evicted_tokens": seq.evicted_tokens}
        if seq.store_id >= 0:   # zoomr: llama.cpp's KV holds every position; the selection saves attention only
            extra["llama_store_cells"] = seq.n_written
        if seq.policy.evicts:
            extra.update(policy=seq.policy.describe(), **seq.policy.stats())
        meter = seq.meter or KVMeter(b, getattr(seq.policy, "bound", seq.policy.cap) if seq.policy.evicts else None,
                                     self.kv_device)
        return meter.stats(len(seq.tokens), seq.n_written, len(seq.tokens) * b, extra)
