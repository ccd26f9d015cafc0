"""``zoomr solve FILE --rescue``: model loading, the run under the live or plain view, results and ``--json``.

:func:`solve_with_rescue` builds the base (evicting policy), the helper (full KV) and the scorer from a
:class:`zoomr.rescue.plan.RescuePlan`, runs them through the library's :func:`zoomr.rescue.runner.run_rescue`
(the run ``zoomr.run_rescue`` makes), prints the answer and statistics and writes the JSON record — also
after Ctrl-C (exit 130). Nothing of the loop or its transcript is built here: this module loads and renders.
"""

from __future__ import annotations

import contextlib
import signal

from zoomr.errors import UserError

from zoomr.factory import build_backend, check_options
from zoomr.solving import solve_ids
from zoomr.options import RunOptions
from zoomr.cli.options import loading
from zoomr.cli.inputs import write_json
from zoomr.cli.render import Output, mib
from zoomr.rescue.runner import build_helper, helper_is_base, run_rescue
from zoomr.rescue.plan import RescueOptions, for_flag, plan_rescue
from zoomr.cli.rescue_view import LiveView, PlainView
from zoomr.rescue.scorers import build_scorer


def _kv_line(role: str, kv: dict) -> str:
    return (f"{role} KV {kv['active_tokens']}/{kv['full_tokens']} tok active/full "
            f"({mib(kv['active_bytes'])} / {mib(kv['full_bytes'])}, peak {kv['peak_active_tokens']} tok)")


class CtrlC:
    """While active, the first Ctrl-C (or SIGTERM) only sets a flag that the loop polls before every token, so the run
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
        # SIGTERM (kill) ends the run the same clean way: committed steps and --json kept
        try:
            self._prev = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread
            self._prev = None
        return self

    def __exit__(self, *exc) -> bool:
        for sig, prev in (self._prev or {}).items():
            signal.signal(sig, prev)
        return False


def print_summary(out: Output, s: dict) -> None:
    """Answer, step sources, tokens, aborts, scorer, detector and KV lines on stdout."""
    out.result("answer", s["answer"] if s["answer"] is not None else "(none found)")
    n = len(s["steps"])
    helper = sum(st["source"] == "helper" for st in s["steps"])
    out.result("rescue", f"{n} step{'' if n == 1 else 's'} (base {n - helper}, helper {helper}: helper share {s['helper_share']:.0%}) · "
               f"candidates base {s['candidates']['base']} (aborted {s['aborted']}), helper {s['candidates']['helper']}"
               f" · generated base {s['base_tokens']} tok, helper {s['helper_tokens']} tok · stop: {s['stop_reason']}",
               style="dim")
    out.result("scorer", s["scorer"] or "", style="dim")
    out.result("detector", s["detector"] or "", style="dim")
    for role in ("base", "helper"):
        if role in s["kv"]:
            out.result("kv", _kv_line(role, s["kv"][role]), style="dim")


def solve_with_rescue(problem: str, system: str | None, json_path: str | None, out: Output, opts: RunOptions,
                      ropts: RescueOptions) -> int:
    """``zoomr solve --rescue``: load the models ``ropts`` and ``opts`` name, run KV-Rescue on one problem
    (:func:`zoomr.rescue.runner.run_rescue`) under the live or plain view, print the summary, write ``--json``.

    Args:
        problem: the problem text; system: the user's ``--system`` (the base's summary instruction is the
            library's to add, :func:`zoomr.solving.solve_ids`).
        json_path: where the record goes (``-``: stdout), or None; out: the terminal output.
        opts: the model flags (the base's); ropts: the ``--rescue`` flags.
    Returns:
        the exit code: 0, or 130 after Ctrl-C or SIGTERM (the committed steps are printed and recorded).
    Raises:
        UserError / ValueError: bad flags or models, a prompt over ``-c`` (one line, exit 2), before any
            model past the one that showed it loads.
    """
    if opts.ignore_eos:   # a committed end-of-sequence ends the run: the loop cannot be made to fill -n
        raise UserError("--ignore-eos does not apply to --rescue: its run ends at a committed end-of-sequence, "
                        "-n, -c or --max-steps")
    plan = plan_rescue(ropts, opts)
    sampling = opts.sampling(default_temp=0.8).validate()  # bad values refused before any model loads
    for flag, flag_opts in (("base", plan.base_opts), ("--helper", plan.helper_opts)):  # before any model loads
        for_flag(flag, check_options, flag_opts)
    for note in plan.notes:   # after the checks: a refused run prints its error line alone
        out.info(note)
    with loading(out, opts, "loading base model…"):
        base = for_flag("base", build_backend, plan.base_opts)
    # the check plain solve makes, before the helper and scorer load (run_rescue builds the same ids again)
    max_context = plan.config.max_context
    solve_ids(base, problem, system, max_context)
    if plan.prm is None:  # the fallback reads the helper's likelihoods: nothing to load (the view names it)
        scorer = build_scorer(None)
    else:
        with out.status("loading scorer…"):
            scorer = for_flag("--prm", build_scorer, plan.prm, opts.device, opts.dtype)
    if helper_is_base(base, plan.helper_opts):
        out.info("helper: the base model's own weights with full KV (no second load)")
        helper = build_helper(base, plan.helper_opts)
    else:
        with out.status("loading helper model…"):
            helper = for_flag("--helper", build_helper, base, plan.helper_opts)
    # and the helper's, before the live view takes the terminal: a refusal stays the only line after the loads
    solve_ids(helper, problem, system, max_context)

    view = LiveView(out.out) if out.live else PlainView(out)
    ctrl_c = CtrlC()
    # the record's settings after the config's and sampling's: which base the flags chose
    settings = {"base_policy": plan.base_opts.policy, "budget": opts.knob("budget"), "backend": opts.backend}
    with ctrl_c, (view if out.live else contextlib.nullcontext()):
        transcript = run_rescue(base, problem, helper=helper, scorer=scorer, config=plan.config, sampling=sampling,
                                system=system, on_event=view, stop_requested=ctrl_c, settings=settings)
    summary = transcript.summary()
    reason = summary["stop_reason"]
    print_summary(out, summary)
    if json_path:
        where = write_json(json_path, transcript.record(problem), indent=1)
        if json_path != "-":   # a record on stdout speaks for itself
            out.info(f"wrote {where}")
    if reason == "interrupted":
        out.info("interrupted: committed steps kept above" + (f" and in {where}" if json_path else ""))
        return 130
    return 0
