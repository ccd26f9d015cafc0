"""When R-KV and SnapKV compress during decoding: R-KV's step-length schedule, kept per sequence.

Source: R-KV's runner (github Zefan-Cai/R-KV, ``rkv/modeling.py`` ``CausalLM_forward`` and the attention
forwards; ``run_math.py`` defaults ``--divide_method step_length --divide_length 128``) and the TriAttention
authors' copy of the same runner (github WeianMao/triattention, ``triattention/integration/modeling.py``),
which runs R-KV's and SnapKV's baselines. A model-level counter ``length`` holds the positions written (the
prompt's length after the prefill, one more per decode step). After each forward the runner sets the flag
``length % divide_length == 0``; the next forward appends its token and, when the flag is set and the cache
holds at least B positions, compresses it to B. Attention in that forward still reads everything; the
compressed cache serves the forwards after it. Neither copy has a function called ``should_compact``; this
counter is the schedule both run.

Kept as the reference runs it: the counter counts the prompt, so after a 200-token prompt the first
compression comes at decode step 57 (256 positions written), then every 128 steps. Put without the flag: the
decode forward that writes a position that is a multiple of 128 (its token at position 256, 384, ...)
compresses, which is how it is computed here, from the forward alone.

Deviations (both are artifacts of the runner's module-level state, and differ between the two copies):

* The flag starts as ``None`` in both, and ``None`` makes the very first forward of the process (the first
  problem's prefill) compress its prompt when it holds at least B positions; later problems' prefills do
  not. Here a prefill never compresses on this schedule (SnapKV compresses its prompt by its own rule).
* R-KV's counter is never reset between problems (TriAttention's is, when the cache is empty). Here it is
  per sequence: the positions the sequence has written.

Generalizations the runners never meet: *the prompt* is the sequence's first forward; a multi-token forward
after it (a chat turn, a KV-Rescue re-base on the other model's step, a later chunk of a prompt that llama.cpp
prefills in chunks of ``n_batch``) compresses when it writes a multiple of the buffer, at its end, so no
compression is skipped or put off to the forward after it. A backend whose cache holds at most
some number of positions (llama.cpp's cells) sets :attr:`BufferSchedule.hard_cap`: a forward reaching it
compresses whatever the schedule says.
"""

from __future__ import annotations

import torch

from .policy import ForwardInfo, LayerView, QueryWindow, ScoredPolicy


class BufferSchedule:
    """R-KV's compression schedule for one sequence (see the module docstring).

    Args:
        buffer: ``divide_length``, the positions written between two compressions (tokens; R-KV: 128).
    Raises:
        ValueError: buffer < 1.

    Attributes:
        prompt_tokens: positions written by the prompt (tokens); 0 before it ran.
        hard_cap: most positions the cache may attend (tokens), or None (no limit): a forward attending
            that many compresses off-schedule. Set by a backend whose cache is a fixed number of cells.
    """

    def __init__(self, buffer: int):
        if buffer < 1:
            raise ValueError(f"the compression buffer must be at least 1 token, got {buffer}")
        self.buffer = buffer
        self.prompt_tokens = 0
        self.hard_cap: int | None = None

    @staticmethod
    def is_prompt(view: LayerView) -> bool:
        """Whether ``view``'s forward is the prompt: the sequence's first forward."""
        return view.start == 0

    def due(self, view: LayerView) -> bool:
        """Whether ``view``'s forward compresses by the schedule: a forward after the prompt that writes a
        position that is a multiple of ``buffer`` (a one-token forward: when the positions written before it
        are a multiple of ``buffer``)."""
        if view.start == 0:
            return False
        last = view.start + view.n_new - 1
        return last // self.buffer != (view.start - 1) // self.buffer

    def over_cap(self, n_attended: int) -> bool:
        """Whether ``n_attended`` positions reach :attr:`hard_cap` (never without one)."""
        return self.hard_cap is not None and n_attended >= self.hard_cap

    def end_forward(self, fwd: ForwardInfo) -> None:
        """Account a finished forward (the policy's ``end_forward`` calls this first): the prompt's length."""
        if fwd.start == 0:
            self.prompt_tokens = fwd.end

    def first_peak(self) -> int:
        """Positions attended by the first compressing decode step, if the prompt is still whole then: the
        first multiple of ``buffer`` at or after the prompt's end, plus the token of that step (tokens; 0
        before the prompt ran)."""
        if not self.prompt_tokens:
            return 0
        return -(-self.prompt_tokens // self.buffer) * self.buffer + 1

    def copy(self) -> "BufferSchedule":
        """An independent copy (for a fork)."""
        other = BufferSchedule.__new__(BufferSchedule)
        other.__dict__.update(self.__dict__)
        return other


class WindowScheduledPolicy(ScoredPolicy):
    """Base of R-KV and SnapKV: an observation window of queries (:class:`zoomr.kvstore.policy.QueryWindow`)
    and a :class:`BufferSchedule`, kept per sequence and copied by a fork. Subclasses call
    :meth:`init_window` in their constructor and decide in ``observe`` when to compress."""

    def init_window(self, window: int, buffer: int) -> None:
        """Start an empty observation window of ``window`` queries and a schedule of ``buffer`` tokens."""
        self.queries = QueryWindow(window)
        self.schedule = BufferSchedule(buffer)

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """Advance the schedule; shared selection: the forward's selection (see :class:`ScoredPolicy`)."""
        self.schedule.end_forward(fwd)
        return super().end_forward(fwd)

    def state_tensors(self):
        """The observation window's queries: per layer up to ``window`` + one forward's [H, t, d], in the
        model's dtype."""
        return self.queries.tensors()

    def fork(self, ctx):
        """Shares the query window's tensors (replaced, never written): O(L) per fork; the schedule is copied."""
        other = self._fork_shallow(ctx)
        other.queries = self.queries.copy()
        other.schedule = self.schedule.copy()
        return other
