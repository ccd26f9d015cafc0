"""``zoomr solve FILE --rescue``: model loading, the run under the live or plain view, results and ``--json``.

:func:`run_rescue` builds the base (evicting policy), the helper (full KV) and the scorer from a
:class:`zoomr_cli.rescue_options.RescuePlan`, runs :class:`zoomr_cli.rescue.RescueLoop`, prints the
answer and statistics and writes the JSON record — also after Ctrl-C (exit 130).
"""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Callable

from backends.models import resolve_model
from backends.sampling import Sampler

from .events import EventStream
from .factory import build_backend
from .kv_display import system_with_summaries
from .options import RunOptions
from .render import Output, mib
from .rescue import RescueConfig, RescueLoop
from .rescue_engine import Engine
from .rescue_options import RescueOptions, for_flag, plan_rescue
from .rescue_record import Transcript
from .rescue_view import LiveView, PlainView
from .scorers import build_scorer


def build_helper(base, helper_opts: RunOptions):
    """The helper's backend (full KV). On torch, a helper that is the base's own model shares its weights
    (one copy in memory, no second load): only the KV cache factory differs."""
    if helper_opts.backend == "torch" and resolve_model(helper_opts.model) == base.source:
        return base.with_cache_factory(None)
    return build_backend(helper_opts)


def _kv_line(role: str, kv: dict) -> str:
    return (f"{role} KV {kv['active_tokens']}/{kv['full_tokens']} tok active/full "
            f"({mib(kv['active_bytes'])} / {mib(kv['full_bytes'])}, peak {kv['peak_active_tokens']} tok)")


class CtrlC:
    """While active, the first Ctrl-C only sets a flag that the loop polls before every token, so the run
    ends cleanly wherever it is (Python would otherwise raise KeyboardInterrupt wherever the signal lands,
    including inside llama.cpp's C log callback, where ctypes swallows it). A second Ctrl-C interrupts at once.
    Outside the main thread it does nothing (signal handlers can only be set there)."""

    def __init__(self):
        self.pressed = False
        self._prev = None

    def __call__(self) -> bool:
        return self.pressed

    def _handler(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> "CtrlC":
        try:
            self._prev = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self._prev = None
        return self

    def __exit__(self, *exc) -> bool:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
        return False


def print_summary(out: Output, s: dict) -> None:
    """Answer, step sources, tokens, aborts and KV lines on stdout."""
    out.result("answer", s["answer"] if s["answer"] is not None else "(none found)")
    n = len(s["steps"])
    helper = sum(st["source"] == "helper" for st in s["steps"])
    out.result("rescue", f"{n} steps (base {n - helper}, helper {helper}: helper share {s['helper_share']:.0%}) · "
               f"candidates base {s['candidates']['base']} (aborted {s['aborted']}), helper {s['candidates']['helper']}"
               f" · generated base {s['base_tokens']} tok, helper {s['helper_tokens']} tok · stop: {s['stop_reason']}",
               style="dim")
    out.result("scorer", s["scorer"] or "", style="dim")
    for role in ("base", "helper"):
        if role in s["kv"]:
            out.result("kv", _kv_line(role, s["kv"][role]), style="dim")


def rescue_once(base, helper, scorer, sampler: Sampler, config: RescueConfig, question: str, base_ids: list[int],
                helper_ids: list[int], settings: dict | None = None, observers=(),
                stop_requested: Callable[[], bool] = lambda: False) -> tuple[str, Transcript]:
    """One KV-Rescue run over already built models; both committed states are freed afterwards.

    Args:
        base: evicting backend; helper: full-KV backend; scorer: see :mod:`zoomr_cli.scorers`.
        base_ids, helper_ids: each model's prompt (tokens).
        observers: extra event subscribers (views), called after the transcript.
    Returns:
        (stop reason, the :class:`Transcript` of every event).
    Raises:
        ValueError: a prompt longer than ``config.max_context``.
    """
    events, transcript = EventStream(), Transcript()
    for sub in (transcript, *observers):
        events.subscribe(sub)
    loop = RescueLoop(Engine("base", base), Engine("helper", helper), scorer, sampler, config, events,
                      stop_requested)
    try:
        reason = loop.run(question, base_ids, helper_ids, settings)
    finally:
        loop.close()
    return reason, transcript


def run_rescue(problem: str, system: str | None, json_path: str | None, out: Output, opts: RunOptions,
               ropts: RescueOptions) -> int:
    """Run KV-Rescue on one problem; returns the exit code (0, or 130 after Ctrl-C).

    Raises:
        UserError / ValueError: bad flags or models (one line, exit 2).
    """
    plan = plan_rescue(ropts, opts)
    sampler = Sampler(opts.sampling(default_temp=0.8))
    for note in plan.notes:
        out.info(note)
    with out.status("loading scorer…"):
        scorer = for_flag("--prm", build_scorer, plan.prm, opts.device, opts.dtype)
    with out.status("loading base model…"):
        base = for_flag("base", build_backend, plan.base_opts)
    with out.status("loading helper model…"):
        helper = for_flag("--helper", build_helper, base, plan.helper_opts)
    base_system = system_with_summaries(system, plan.base_opts.policy, opts.summaries)
    from .solve import solve_prompt  # solve imports this module: a top-level import would be circular

    base_ids = solve_prompt(base.tokenizer, problem, base_system)
    helper_ids = solve_prompt(helper.tokenizer, problem, system)

    view = LiveView(out.out) if out.live else PlainView(out)
    ctrl_c = CtrlC()
    settings = {"sampling": vars(sampler.params), "base_policy": plan.base_opts.policy, "budget": opts.budget,
                "backend": opts.backend}
    with ctrl_c, (view if out.live else contextlib.nullcontext()):
        reason, transcript = rescue_once(base, helper, scorer, sampler, plan.config, problem, base_ids, helper_ids,
                                         settings, observers=(view,), stop_requested=ctrl_c)
    summary = transcript.summary()
    print_summary(out, summary)
    if json_path:
        Path(json_path).write_text(json.dumps(transcript.record(problem), indent=1, ensure_ascii=False))
        out.info(f"wrote {json_path}")
    if reason == "interrupted":
        out.info("interrupted: committed steps kept above" + (f" and in {json_path}" if json_path else ""))
        return 130
    return 0
