"""Continuous batching of bench cells (``zoomr bench -np N``): up to N sequences decode in one forward.

Two kinds of job share one batch, each with its own sequence and KV policy: a cell's free-running
generation (its own sampler and token count) and a teacher-forced fidelity pass (the policy fed full KV's
tokens, its next-token distribution compared with full KV's where the logits live, so only numbers reach
the host). A job that ends (EOS, ``-n``, ``-c``, the last reference token) leaves the batch at once and the
next ready job is prefilled into its place, so the batch stays full while work is left (continuous batching,
as vLLM's scheduler or llama.cpp's server slots). A fidelity pass is ready once full KV's run of its problem
has finished. Greedy fp32 batches give each sequence the tokens it gets alone (``tests/backends/test_batch.py``),
so records equal ``-np 1``'s but for timings and the last bits of the KL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from zoomr.backends.base import Backend
from zoomr.backends.memory import available_bytes
from zoomr.backends.generation import GenerationStats, SequenceProgress, banned_ids
from zoomr.backends.sampling import Sampler, SamplingParams, sample_batch
from zoomr.errors import UserError

from zoomr.evaluation.cells import Reference, cell_record
from zoomr.evaluation.datasets import Problem
from zoomr.evaluation.metrics import FidelityMeter, fidelity_terms


class GenerationJob:
    """One cell's free-running generation, as :func:`zoomr.backends.generation.generate` runs it alone.

    Args:
        backend: a backend view whose new sequences run the cell's policy.
        problem, prompt: the problem and its prompt ids (tokens).
        sampling: the cell's sampling (the job draws from its own seeded stream).
        n_predict: most tokens to generate (tokens); < 0 until EOS or ``-c``.
        keep_logits: keep every sampled row on the device, to become :attr:`reference` (full KV's run).
        ignore_eos: never sample an end id (``--ignore-eos``).
        hold_reference: keep :attr:`reference` after the last :class:`FidelityJob` reading it is done (a
            caller that needs it later); without it the [n, vocab] rows are released then.
    Attributes:
        record: the cell's record fields (:func:`zoomr.evaluation.cells.cell_record`) once done.
        reference: with ``keep_logits``, the run as a :class:`Reference` (logits [n, vocab] on the device).
    """

    def __init__(self, backend: Backend, problem: Problem, prompt: list[int], sampling: SamplingParams,
                 n_predict: int, keep_logits: bool = False, ignore_eos: bool = False, hold_reference: bool = False):
        self.backend, self.problem, self.prompt = backend, problem, prompt
        self.sampler, self.n_predict, self.keep_logits = Sampler(sampling), n_predict, keep_logits
        self.banned = banned_ids(backend, ignore_eos)
        self.stats = GenerationStats()
        self.points: list[tuple[int, int]] = []
        self.rows: list[torch.Tensor] = []
        self.record: dict | None = None
        self.reference: Reference | None = None
        self.hold_reference, self.readers = hold_reference, 0  # readers: fidelity jobs not done yet
        self.done = False
        self.cell = None  # the CellRun this job belongs to (set by run_cells)

    def ready(self) -> bool:
        return True

    def start(self, seq, prefill_s: float, t0: float) -> None:
        """The prompt is in ``seq`` (prefilled with others in ``prefill_s`` seconds, from ``t0``)."""
        self.seq, self.t0 = seq, t0
        self.stats.prefill_s, self.stats.prompt_tokens = prefill_s, len(self.prompt)
        self.progress = SequenceProgress(self.backend, seq, self.n_predict, self.stats, ())

    def open(self) -> bool:
        """Whether a token is still to be sampled (False: stop reason ``length``)."""
        return self.progress.has_room()

    def take(self, token: int, row: torch.Tensor) -> int | None:
        """Accept the id sampled from ``row`` ([vocab], raw logits); the id to decode next, or None when done."""
        if self.progress.accept(token) is None:
            return None
        if self.keep_logits:
            self.rows.append(row.clone())
        kv = self.backend.kv_stats(self.seq)  # before the token's decode, as generate() yields it
        self.points.append((kv.full_tokens - len(self.prompt), kv.active_tokens))
        return None if self.progress.context_full() else token

    def decoded(self, seconds: float) -> bool:
        """Count one decode forward; False when the job is done (a stop string)."""
        return not self.progress.decoded(seconds)

    def finish(self) -> None:
        kv = self.backend.kv_stats(self.seq)
        self.backend.free(self.seq)
        self.record = cell_record(self.problem, self.prompt, self.stats, kv, self.points,
                                  time.perf_counter() - self.t0)
        if self.keep_logits:
            self.reference = Reference(list(self.stats.token_ids),
                                       torch.stack(self.rows) if self.rows else torch.empty(0))
        self.rows, self.done = [], True


class FidelityJob:
    """Teacher-forced fidelity of one policy to full KV: prefill, then full KV's tokens one decode each,
    every next-token distribution compared with full KV's (``fidelity_terms``, on the device).

    Args:
        backend: a backend view whose new sequences run the policy under test.
        prompt: the prompt ids (tokens) full KV's run started from.
        source: full KV's :class:`Reference`, or the :class:`GenerationJob` that will make it (the job is
            ready once that one is done).
    Attributes:
        result: ``{"fidelity_top1", "fidelity_kl" (nats/token), "fidelity_tokens"}`` once done.
        mean_active_tokens: the pass's own time-averaged active KV (tokens) once done.
    """

    def __init__(self, backend: Backend, prompt: list[int], source: "Reference | GenerationJob"):
        self.backend, self.prompt, self.source = backend, prompt, source
        if isinstance(source, GenerationJob):
            source.readers += 1
        self.meter = FidelityMeter()
        self.i = 0
        self.result: dict | None = None
        self.done = False
        self.cell = None

    @property
    def ref(self) -> Reference:
        return self.source if isinstance(self.source, Reference) else self.source.reference

    def ready(self) -> bool:
        return isinstance(self.source, Reference) or self.source.done

    def start(self, seq, prefill_s: float, t0: float) -> None:
        self.seq = seq

    def open(self) -> bool:
        return self.i < len(self.ref.tokens)

    def reference_row(self) -> torch.Tensor:
        return self.ref.logits[self.i]

    def take(self, kl: torch.Tensor, agree: torch.Tensor) -> int | None:
        """Count this position; the reference token to decode next, or None after the last one."""
        self.meter.accumulate(kl, agree)
        if self.i + 1 >= len(self.ref.tokens):
            return None
        self.i += 1
        return self.ref.tokens[self.i - 1]

    def decoded(self, seconds: float) -> bool:
        return True

    def finish(self) -> None:
        self.mean_active_tokens = self.backend.kv_stats(self.seq).mean_active_tokens
        self.backend.free(self.seq)
        self.result, self.done = self.meter.result(), True
        if isinstance(self.source, GenerationJob):
            # N problems' references on the device, not every problem's: the last reader releases them
            self.source.readers -= 1
            if not self.source.readers and not self.source.hold_reference:
                self.source.reference = None
        self.source = None


Job = GenerationJob | FidelityJob


def _sample(jobs: list[GenerationJob], rows: torch.Tensor) -> list[int]:
    """One id per generation job from its row of ``rows`` [G, vocab] (its ``--ignore-eos`` ids masked)."""
    banned = [(k, j.banned) for k, j in enumerate(jobs) if j.banned is not None]
    if banned:
        rows = rows.clone()
        for k, ids in banned:
            rows[k, torch.from_numpy(ids).to(rows.device)] = -torch.inf
    ids, _ = sample_batch(rows, [j.sampler for j in jobs])
    return [int(t) for t in ids]


def _is_reference(job: Job) -> bool:
    """A full-KV run whose logits fidelity jobs wait on."""
    return isinstance(job, GenerationJob) and job.keep_logits


def _next_job(pending: list[Job], references_welcome: bool, idle: bool) -> int | None:
    """Index in ``pending`` of the job to join the batch next (None: none should join now).

    A reference run goes first while fewer than ``-np`` references are alive, so the fidelity passes waiting
    on it become ready a round earlier; otherwise the first ready job in list order that is not a reference
    run. Without that order, 8 problems of full + rkv at ``-np 8`` ran in four rounds of 128 steps, the last
    two 6/8 and 2/8 full (their passes waited on references started late); references first, three full
    rounds. Capping live references at ``-np`` keeps the reference logits held on the device where
    :func:`check_parallel` counted them. A reference run past the cap still joins a batch that would otherwise
    be empty (``idle``).
    """
    ready = [i for i, j in enumerate(pending) if j.ready()]
    refs = [i for i in ready if _is_reference(pending[i])]
    if refs and references_welcome:
        return refs[0]
    others = [i for i in ready if not _is_reference(pending[i])]
    if others:
        return others[0]
    return refs[0] if refs and idle else None


def run_batched(base: Backend, jobs: list[Job], n_parallel: int, on_done: Callable[[Job], None] | None = None
                ) -> None:
    """Run ``jobs`` with at most ``n_parallel`` sequences per forward, continuously batched.

    Jobs join as they become ready (a fidelity job after its reference run; the order: :func:`_next_job`,
    reference runs first while fewer than ``n_parallel`` are alive, then list order); each joining group is
    prefilled in one ragged forward, then every running job decodes one token per forward. Per step only the
    sampled ids cross to the host (fidelity stays on the device).

    Args:
        base: the torch backend whose weights every job's view shares (runs ``forward_batch``/``decode_batch``).
        jobs: generation and fidelity jobs (each run once).
        n_parallel: most sequences in one forward (≥ 1).
        on_done: called with each job as it finishes, in finishing order.
    Raises:
        ValueError: ``n_parallel`` < 1, or what the backend raises (a prompt past ``-c``).
    """
    if n_parallel < 1:
        raise ValueError(f"-np must be >= 1, got {n_parallel}")
    pending, active = list(jobs), []
    logits = None  # [len(active), vocab] on the device: each running job's next-token logits
    references: list[GenerationJob] = []   # reference runs started; alive until their last reader is done

    def finish(job: Job) -> None:
        job.finish()
        if on_done is not None:
            on_done(job)

    while pending or active:
        joiners = []
        while len(active) + len(joiners) < n_parallel:
            alive = sum(not j.done or j.reference is not None for j in references)
            k = _next_job(pending, alive < n_parallel, idle=not (active or joiners))
            if k is None:
                break
            joiners.append(pending.pop(k))
            if _is_reference(joiners[-1]):
                references.append(joiners[-1])
        if joiners:
            seqs = [j.backend.new_sequence() for j in joiners]
            t0 = time.perf_counter()
            out = base.forward_batch(seqs, [j.prompt for j in joiners])
            dt = time.perf_counter() - t0
            for j, s in zip(joiners, seqs):
                j.start(s, dt, t0)
            active += joiners
            logits = out if logits is None else torch.cat([logits, out])
        if not active:
            raise RuntimeError("bench jobs wait on a reference run that is not among them")
        tokens: list[int | None] = [None] * len(active)
        live = [k for k, j in enumerate(active) if j.open()]
        gen = [k for k in live if isinstance(active[k], GenerationJob)]
        fid = [k for k in live if isinstance(active[k], FidelityJob)]
        if gen:
            rows = logits[torch.tensor(gen, device=logits.device)]
            for k, token in zip(gen, _sample([active[k] for k in gen], rows)):
                tokens[k] = active[k].take(token, logits[k])
        if fid:
            refs = torch.stack([active[k].reference_row() for k in fid])
            kl, agree = fidelity_terms(refs, logits[torch.tensor(fid, device=logits.device)])
            for n, k in enumerate(fid):
                tokens[k] = active[k].take(kl[n], agree[n])
        going = [k for k, t in enumerate(tokens) if t is not None]
        for k, j in enumerate(active):
            if tokens[k] is None:
                finish(j)
        if not going:
            active, logits = [], None
            continue
        active = [active[k] for k in going]
        t0 = time.perf_counter()
        logits = torch.as_tensor(base.decode_batch([j.seq for j in active], [tokens[k] for k in going],
                                                   on_device=True))
        dt = time.perf_counter() - t0
        keep = [k for k, j in enumerate(active) if j.decoded(dt)]
        if len(keep) < len(active):
            for k, j in enumerate(active):
                if k not in keep:
                    finish(j)
            active = [active[k] for k in keep]
            logits = logits[torch.tensor(keep, device=logits.device)] if keep else None


@dataclass
class CellRun:
    """One bench cell as jobs: its generation, and its fidelity pass when fidelity is measured.

    Attributes:
        key: (problem id, policy, budget) as records name it.
        generation: the free-running generation (full KV's also makes the problem's reference).
        fidelity: the teacher-forced pass, or None.
    """

    key: tuple
    generation: GenerationJob
    fidelity: FidelityJob | None = None

    def done(self) -> bool:
        return self.generation.done and (self.fidelity is None or self.fidelity.done)

    def fields(self) -> dict:
        """The cell's record fields: the generation's, then fidelity's (``fidelity_*``)."""
        return {**self.generation.record, **(self.fidelity.result if self.fidelity is not None else {})}


def run_cells(base: Backend, cells: list[CellRun], n_parallel: int, on_cell: Callable[[CellRun], None]) -> None:
    """Run bench cells continuously batched (:func:`run_batched`); ``on_cell`` gets each cell when all its
    jobs are done, so its record can be written at once (cells may finish in any order)."""
    jobs: list[Job] = []
    for cell in cells:
        for job in (cell.generation, cell.fidelity):
            if job is not None:
                job.cell = cell
                jobs.append(job)

    def done(job: Job) -> None:
        if job.cell.done():
            on_cell(job.cell)

    run_batched(base, jobs, n_parallel, done)


def run_cell(backend: Backend, problem: Problem, prompt: list[int], sampling: SamplingParams, n_predict: int,
             ignore_eos: bool = False) -> dict:
    """One cell's generation alone (no fidelity: :func:`teacher_forced_fidelity` measures it after).

    Returns:
        the record fields (:func:`zoomr.evaluation.cells.cell_record`).
    """
    gen = GenerationJob(backend, problem, prompt, sampling, n_predict, ignore_eos=ignore_eos)
    run_batched(backend, [gen], 1)
    return gen.record


def teacher_forced_fidelity(backend: Backend, prompt: list[int], reference: Reference) -> dict:
    """Fidelity of ``backend``'s policy to full KV's ``reference`` run: ``{"fidelity_top1", "fidelity_kl"
    (nats/token), "fidelity_tokens", "fidelity_mean_active_tokens"}`` (see :class:`FidelityJob`; the last is
    the pass's own time-averaged active KV, tokens)."""
    job = FidelityJob(backend, prompt, reference)
    run_batched(backend, [job], 1)
    return {**job.result, "fidelity_mean_active_tokens": round(job.mean_active_tokens, 2)}


def check_parallel(n_parallel: int, backend, longest_prompt: int, n_predict: int) -> None:
    """Whether ``n_parallel`` sequences fit: on the torch backend every sequence has its own KV cache, so
    ``-c`` bounds each one, not their number; what bounds N is memory. Each sequence may hold
    min(-c, prompt + -n) positions of full K/V (the reference, and what the offloading policies keep on the
    host) plus, for full KV's run, one float32 [vocab] logits row per generated token (the fidelity
    reference, kept on the device); N of them must fit in what the device has free.

    Args:
        n_parallel: ``-np``; backend: the loaded torch backend (shapes, KV dtype, device).
        longest_prompt: the longest prompt to run (tokens); n_predict: ``-n`` (< 0: up to ``-c``).
    Raises:
        UserError: ``-np`` below 1, or N sequences that need more memory than is free (numbers named).
    """
    if n_parallel < 1:
        raise UserError(f"-np must be >= 1 parallel sequence, got {n_parallel}")
    free = available_bytes(backend.device)
    if n_parallel == 1 or free is None:
        return
    cfg = backend.cfg
    generated = backend.n_ctx - longest_prompt if n_predict < 0 else min(n_predict, backend.n_ctx - longest_prompt)
    positions = longest_prompt + generated
    kv = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2 * torch.empty(0, dtype=backend.kv_dtype).element_size()
    need = n_parallel * (positions * kv + generated * cfg.vocab * 4)
    if need > free:
        fits = max(1, n_parallel * free // need)
        raise UserError(f"-np {n_parallel}: {n_parallel} sequences of up to {positions} positions need "
                        f"{need / 2**30:.1f} GiB of KV and reference logits, more than the "
                        f"{free / 2**30:.1f} GiB free on {backend.device.type}; use -np {fits} or less, or a smaller -n/-c")
