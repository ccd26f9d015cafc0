"""The KV-Rescue loop: stepwise interleaving of an evicted base model and a full-context helper.

Source: KV-Rescue (Cheong et al., arXiv:2608.15797), "Stepwise interleaving", the pseudocode and
"Implementation details". Per step t, with committed context c_t = (question, s_<t):

1. fork the base's evicted state N_b times and the helper's full state N_h times;
2. sample each candidate (T 0.8, top-p 0.95, top-k 20 by default) until ``\\n\\n``, EOS or the
   step-token limit (512); base candidates are aborted online by the degeneration detector
   ("early exit", off with ``early_exit=False``): zoomr's calibrated one (:mod:`zoomr.rescue.degeneration`,
   the default), which reads the committed trajectory's tail before each candidate (loops across steps), or
   the paper's as stated (:mod:`zoomr.rescue.paper_detector`, ``detector.name = "paper"``); helper
   candidates keep the pool non-empty;
3. score the survivors (a PRM, or the fallback in :mod:`zoomr.rescue.scorers`) and commit the best;
4. re-base: the winner's fork becomes its model's state (no history token is computed again),
   the other model prefills the committed step (an evicting base evicts back to its budget).

The loop ends at an EOS step, after ``max_steps`` steps (1024), at the context cap (4096 tokens of
committed trajectory) or at ``max_new_tokens`` committed tokens after the prompt (``-n``). ``N_h = 0``
with ``early_exit=False`` is the paper's eviction-only best-of-N baseline (no helper candidate, no early
exit) with the same machinery.

Sampling: every candidate draws from its own stream, seeded by (seed, step, index)
(:meth:`zoomr.backends.sampling.Sampler.substream`), so a candidate's tokens do not depend on which
candidates ran before it or beside it.

Two ways to run a step, same committed steps and transcript for the same seed (``batched``):

* sequential (``batched=False``): candidates run one after another and are scored as they finish,
  so at most three sequences per model are alive at once (the committed state, the best candidate
  so far, the one being sampled) plus one scoring fork of the helper, whatever N_b and N_h are.
  Events come candidate by candidate: started, tokens, finished or aborted, scored.
* batched (default): the N_b base candidates advance as one batch (one ``decode_batch`` forward per
  token on the base), then the N_h helper candidates as one batch on the helper
  (:func:`zoomr.backends.generation.generate_batch`); an aborted candidate leaves its batch at once.
  When both roles run on one set of weights (the torch helper that is the base's own model with full
  KV, ``shares_weights``), all N_b + N_h candidates form a single batch instead, each fork keeping its
  own cache: one read of the weights per token serves both models' candidates.
  All forks of a batch are alive together. Events of one batch interleave: every
  ``candidate_started`` of the batch first, then tokens in forward order (per forward, candidates
  in index order), an abort at the token that triggered it; ``candidate_finished`` of the survivors
  follow the batch in index order, and ``candidate_scored`` after both batches, in index order. The
  entropy per token is computed on the device (:func:`zoomr.backends.sampling.row_entropy`); logits
  of a batched forward may differ from a single one in the last float bits, so the recorded
  entropies and scores agree with the sequential run to rounding, tokens and texts exactly (barring
  a uniform draw landing within that rounding of a probability boundary).
  Both scorers have ``score_batch``: the PRM and the helper-likelihood fallback score all survivors
  of the step in one batched forward (a scorer without it scores them one at a time).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from zoomr.backends.generation import GenerationStats, generate, generate_batch
from zoomr.backends.sampling import Sampler
from zoomr.kvstore.events import Event, EventBus

from zoomr.rescue.degeneration import TAIL_LIMIT, DetectorConfig
from zoomr.rescue.detectors import check_detector, make_detector
from zoomr.rescue.events import (
    CandidateAborted,
    CandidateFinished,
    CandidateScored,
    CandidateStarted,
    CandidateToken,
    KVSnapshot,
    RunFinished,
    RunStarted,
    StepCommitted,
)
from zoomr.grading import extract_answer
from zoomr.solving import check_fits
from zoomr.rescue.engine import Candidate, Engine
from zoomr.rescue.scorers import Scorer, StepContext


@dataclass(frozen=True)
class RescueConfig:
    """Loop settings (paper defaults except the candidate counts, see ``zoomr.cli.rescue``).

    Attributes:
        nb, nh: base and helper candidates per step (N_b, N_h).
        step_tokens: most tokens of one step (tokens).
        max_steps: most committed steps.
        max_context: most tokens of committed trajectory, prompt included, in either model (tokens).
        max_new_tokens: most committed tokens after the prompt, in either model (tokens; ``-n``); ≤ 0:
            no such bound. Reaching it ends the run with ``length``.
        step_end: the text that ends a step.
        detector: degeneration thresholds and which detector reads them (``detector.name``: ``zoomr``, the
            calibrated default, or ``paper``; :mod:`zoomr.rescue.detectors`); base candidates only.
        early_exit: abort base candidates the detector flags (the paper's "early exit"); False keeps
            every candidate (the detector's signals are still computed and reported).
        batched: sample each model's candidates of a step as one batch (see the module docstring);
            False runs them one after another (fewest sequences alive).
    """

    nb: int = 2
    nh: int = 2
    step_tokens: int = 512
    max_steps: int = 1024
    max_context: int = 4096
    max_new_tokens: int = 0
    step_end: str = "\n\n"
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    early_exit: bool = True
    batched: bool = True

    def validate(self) -> "RescueConfig":
        """Return self.

        Raises:
            ValueError: negative counts, no candidates at all, a step or step limit below 1, an unknown
                detector or bad thresholds (one line).
        """
        if self.nb < 0 or self.nh < 0:
            raise ValueError(f"--nb and --nh must be >= 0, got {self.nb} and {self.nh}")
        if self.nb + self.nh == 0:
            raise ValueError("--nb 0 --nh 0 leaves no candidate to commit: give at least one")
        if self.step_tokens < 1:
            raise ValueError(f"--step-tokens must be at least 1, got {self.step_tokens}")
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        check_detector(self.detector.name)
        self.detector.validate()
        return self

    def as_dict(self) -> dict:
        """JSON-ready settings; ``detector`` holds its ``name`` and the thresholds that detector reads."""
        return {**asdict(self), "detector": self.detector.as_dict()}


@dataclass
class CommittedStep:
    """One step of the trajectory: who wrote it, its score, text and length in its model's tokens."""

    source: str
    score: float
    text: str
    tokens: int


class RescueLoop:
    """Runs KV-Rescue for one question and reports every action on ``events``.

    Args:
        base: the evicted model's engine; helper: the full-KV model's engine (always present: it
            follows the trajectory and may score even when ``nh`` is 0).
        scorer: see :mod:`zoomr.rescue.scorers`.
        sampler: its settings and seed draw every candidate's tokens, each candidate from its own stream
            (:meth:`Sampler.substream` keyed by step and index: runs are reproducible).
        config: validated here.
        events: where events go (subscribe the views and the transcript first).
        stop_requested: polled before every sampled token; True ends the run like Ctrl-C (the CLI sets it
            from a SIGINT handler: a KeyboardInterrupt raised inside a C callback of llama.cpp is lost).
    Raises:
        ValueError: see :meth:`RescueConfig.validate`.
    """

    def __init__(self, base: Engine, helper: Engine, scorer: Scorer, sampler: Sampler, config: RescueConfig,
                 events: EventBus[Event], stop_requested: Callable[[], bool] = lambda: False):
        self.base, self.helper, self.scorer, self.sampler = base, helper, scorer, sampler
        self.config = config.validate()
        self.events = events
        self.stop_requested = stop_requested
        self.steps: list[CommittedStep] = []

    @property
    def text(self) -> str:
        """The committed solution so far."""
        return "".join(s.text for s in self.steps)

    def run(self, question: str, base_prompt: list[int], helper_prompt: list[int],
            settings: dict | None = None) -> str:
        """Solve ``question`` from the two models' prompts; returns the stop reason (see
        :class:`zoomr.rescue.events.RunFinished`). Ctrl-C ends the loop cleanly with ``interrupted``: what
        was committed stays, every candidate fork is freed.

        Raises:
            UserError: a prompt longer than the context cap (:func:`zoomr.solving.check_fits`).
        """
        t0 = time.perf_counter()
        check_fits(max(len(base_prompt), len(helper_prompt)), self.config.max_context)
        self.question = question
        self.base.start(base_prompt)
        self.helper.start(helper_prompt)
        self.events.emit(RunStarted(question, self.base.backend.describe(), self.helper.backend.describe(),
                                    self.scorer.name, {**self.config.as_dict(), **(settings or {})},
                                    {"base": len(base_prompt), "helper": len(helper_prompt)},
                                    {e.role: e.backend.kv_stats(e.seq).as_dict() for e in (self.base, self.helper)}))
        reason = "max_steps"
        cap = self.config.max_new_tokens
        try:
            for step in range(self.config.max_steps):
                if self.stop_requested():
                    raise KeyboardInterrupt
                room = self.config.max_context - max(self.base.length, self.helper.length)
                if room < 1:
                    reason = "context"
                    break
                if cap > 0:
                    left = cap - max(self.base.length - len(base_prompt), self.helper.length - len(helper_prompt))
                    if left < 1:
                        reason = "length"
                        break
                    room = min(room, left)
                best, survivors = self._step(step, min(self.config.step_tokens, room))
                if best is None:
                    reason = "degenerate"
                    break
                self._commit(best, survivors)
                if best.final:
                    reason = "eos"
                    break
        except KeyboardInterrupt:
            reason = "interrupted"
        # only a run that ended at EOS ended its text: any other stop may have cut the last answer mid-number
        self.events.emit(RunFinished(extract_answer(self.text, truncated=reason != "eos"), reason, len(self.steps),
                                     round(time.perf_counter() - t0, 3)))
        return reason

    def close(self) -> None:
        """Free both committed states."""
        self.base.close()
        self.helper.close()

    # --- one step --------------------------------------------------------------------------------

    def _step(self, step: int, n_tokens: int) -> tuple[Candidate | None, int]:
        """Sample, check and score every candidate of ``step``; keep only the best one's fork alive."""
        ctx = StepContext(self.question, [s.text for s in self.steps], self.helper)
        nb, nh = self.config.nb, self.config.nh
        plan = [self.base] * nb + [self.helper] * nh
        best: Candidate | None = None
        survivors = 0
        sampled: list[Candidate | None] = []   # batched: every candidate, sampled before any is scored
        try:
            if self.config.batched:
                members = list(enumerate(plan))
                # one model's weights behind both roles: all N_b + N_h candidates share each forward
                groups = [members] if _shares_weights(self.base, self.helper) else [members[:nb], members[nb:]]
                for group in groups:
                    if group:
                        sampled += self._sample_batch(step, group, n_tokens)
            scores: dict[int, float] = {}
            batch_score = getattr(self.scorer, "score_batch", None)
            if sampled and batch_score is not None:
                alive = [c for c in sampled if c is not None]
                scores = dict(zip((c.index for c in alive), batch_score(ctx, alive) if alive else []))
            for index, engine in enumerate(plan):
                cand = sampled[index] if sampled else self._sample(step, index, engine, n_tokens)
                if cand is None:
                    continue
                survivors += 1
                score = scores[index] if index in scores else self.scorer.score(ctx, cand)
                cand.score = -math.inf if math.isnan(score) else float(score)
                self.events.emit(CandidateScored(step, index, cand.source, cand.score, self.scorer.name))
                if best is None or cand.score > best.score:  # ties keep the earlier candidate
                    cand, best = best, cand
                if cand is not None:  # whichever lost: its fork is no longer needed
                    _drop(cand)
        except BaseException:
            for cand in [best, *sampled]:
                if cand is not None:
                    _drop(cand)
            raise
        return best, survivors

    def _sample_batch(self, step: int, members: list[tuple[int, Engine]], n_tokens: int) -> list[Candidate | None]:
        """Candidates ``members`` (index, engine), sampled together (one forward per token for all that
        still run, on the first engine's backend: the engines of one batch share weights); None where the
        detector aborted one. Same events as :meth:`_sample` per candidate, interleaved (see the module
        docstring)."""
        indices = [index for index, _ in members]
        engines = [engine for _, engine in members]
        for index, engine in members:
            self.events.emit(CandidateStarted(step, index, engine.role))
        seqs: list = []
        try:
            seqs = [engine.fork() for engine in engines]
            detectors = [self._detector() for _ in members]
            gens = [GenerationStats() for _ in members]

            def on_token(b: int, tok) -> bool:
                if self.stop_requested():
                    raise KeyboardInterrupt
                engine = engines[b]
                engine.generated += 1
                sig = detectors[b].observe(tok.text, tok.entropy)
                kv = engine.backend.kv_stats(seqs[b])
                self.events.emit(CandidateToken(step, indices[b], engine.role, tok.token, tok.text, sig.tokens,
                                                round(sig.entropy, 4), round(sig.mean_entropy, 4),
                                                round(sig.gzip_ratio, 4), kv.active_tokens, kv.active_bytes,
                                                kv.full_tokens, kv.full_bytes))
                if sig.abort and engine.role == "base" and self.config.early_exit:
                    self.events.emit(CandidateAborted(step, indices[b], engine.role, sig.abort, sig.tokens,
                                                      sig.as_dict(), gens[b].text))
                    engine.release(seqs[b])
                    seqs[b] = None
                    return True
                return False

            logits = np.stack([engine.next_logits for engine in engines])
            generate_batch(engines[0].backend, list(seqs), [self.sampler.substream(step, i) for i in indices],
                           n_tokens, gens, logits, stop=(self.config.step_end,), entropy=True, on_token=on_token)
        except BaseException:
            for engine, seq in zip(engines, seqs):
                engine.release(seq)
            raise
        out: list[Candidate | None] = []
        for b, (index, engine) in enumerate(members):
            gen = gens[b]
            if seqs[b] is None:
                out.append(None)
                continue
            self.events.emit(CandidateFinished(step, index, engine.role, gen.stop_reason, gen.generated_tokens,
                                               gen.text))
            out.append(Candidate(step, index, engine.role, engine, seqs[b], list(gen.token_ids), gen.text,
                                 gen.stop_reason, gen.next_logits))
        return out

    def _sample(self, step: int, index: int, engine: Engine, n_tokens: int) -> Candidate | None:
        """One candidate from a fork of ``engine``'s committed state; None when the detector aborted it.

        Each token event carries the KV the candidate's fork attended at the forward its logits came
        from, so the committed trajectory's KV can be averaged per token (see
        :meth:`zoomr.rescue.transcript.Transcript.trajectory_kv`)."""
        src = engine.role
        self.events.emit(CandidateStarted(step, index, src))
        detector = self._detector()
        gen = GenerationStats()
        seq = engine.fork()
        try:
            for tok in generate(engine.backend, seq, [], self.sampler.substream(step, index), n_tokens, gen, stop=(self.config.step_end,),
                                logits=engine.next_logits):
                if self.stop_requested():
                    raise KeyboardInterrupt
                engine.generated += 1
                sig = detector.push(tok.text, tok.logits)
                kv = engine.backend.kv_stats(seq)
                self.events.emit(CandidateToken(step, index, src, tok.token, tok.text, sig.tokens,
                                                round(sig.entropy, 4), round(sig.mean_entropy, 4),
                                                round(sig.gzip_ratio, 4), kv.active_tokens, kv.active_bytes,
                                                kv.full_tokens, kv.full_bytes))
                if sig.abort and src == "base" and self.config.early_exit:  # the paper screens base candidates only
                    self.events.emit(CandidateAborted(step, index, src, sig.abort, sig.tokens, sig.as_dict(),
                                                      gen.text))
                    engine.release(seq)
                    return None
        except BaseException:
            engine.release(seq)
            raise
        self.events.emit(CandidateFinished(step, index, src, gen.stop_reason, gen.generated_tokens, gen.text))
        return Candidate(step, index, src, engine, seq, list(gen.token_ids), gen.text, gen.stop_reason,
                         gen.next_logits)

    def _detector(self):
        """A detector of the configured kind for one candidate of this step; ``zoomr``'s reads the committed
        trajectory's tail before it (a loop across steps aborts the candidate that continues it), the paper's
        only the candidate. Helper candidates get the same one: their
        signals are reported alike, but only base candidates are aborted (the paper's helper keeps the pool
        non-empty; a helper that loops too goes on until ``max_steps`` or the context cap)."""
        return make_detector(self.config.detector, history=self.text[-TAIL_LIMIT:], step_end=self.config.step_end)

    def _commit(self, best: Candidate, survivors: int) -> None:
        """Append ``best`` to the trajectory and re-base both models on it."""
        winner, other = (self.base, self.helper) if best.source == "base" else (self.helper, self.base)
        other_ids = other.ids_of(best)
        winner.adopt(best)
        prefilled = other.extend(other_ids)
        self.steps.append(CommittedStep(best.source, best.score, best.text, len(best.ids)))
        self.events.emit(StepCommitted(best.step, best.index, best.source, best.score, best.text, len(best.ids),
                                       self.config.nb + self.config.nh, survivors,
                                       {winner.role: 0, other.role: prefilled}, best.final))
        for engine in (self.base, self.helper):
            self.events.emit(KVSnapshot(best.step, engine.role, engine.backend.kv_stats(engine.seq).as_dict()))


def _shares_weights(a: Engine, b: Engine) -> bool:
    """Both roles run on one set of weights (the torch backend's helper view of the base's own model), so
    their candidates can share a batch; a backend without ``shares_weights`` never does."""
    check = getattr(a.backend, "shares_weights", None)
    return check is not None and check(b.backend)


def _drop(cand: Candidate) -> None:
    """Free a candidate's fork once (its ``seq`` becomes None)."""
    cand.engine.release(cand.seq)
    cand.seq = None
