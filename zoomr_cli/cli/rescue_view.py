"""What a person sees of a KV-Rescue run: a rich live view, or plain committed steps (``--no-live``).

Both are subscribers of the run's event bus (:class:`zoomr.kvstore.events.EventBus`; the events are in
:mod:`zoomr.rescue.events`).

Live view: committed steps are printed permanently as they are committed (the trajectory grows
upward on the terminal); below them a live table shows the current step's candidates side by side:
source, tokens, mean entropy and gzip ratio (the detector's signals), status (sampling, stop reason,
abort with its reason and values, score, committed) and the tail of the text.
"""

from __future__ import annotations

import threading

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from zoomr.kvstore.events import Event
from zoomr.rescue.events import (
    CandidateAborted,
    CandidateFinished,
    CandidateScored,
    CandidateStarted,
    CandidateToken,
    KVSnapshot,
    RunStarted,
    StepCommitted,
)
from zoomr.cli.render import Output

SOURCE_STYLE = {"base": "cyan", "helper": "magenta"}
STOP_LABEL = {"stop": "¶ end of step", "eos": "EOS", "length": "step-token limit", "context": "context full"}


def step_header(ev: StepCommitted) -> str:
    """``step 3 · helper · score -0.412 · 38 tok`` (1-based step number)."""
    return f"step {ev.step + 1} · {ev.source} · score {ev.score:.3f} · {ev.tokens} tok" + (" · final" if ev.final else "")


def abort_reason(ev: CandidateAborted, detector: dict) -> str:
    """Why a candidate was aborted: the signal, its value and the threshold it crossed."""
    s = ev.signals
    if ev.reason == "entropy":
        return f"entropy {s['mean_entropy']:.2f} > {detector.get('max_entropy', '?')} nats"
    if ev.reason == "cycle":
        if s.get("copies", 0) >= detector.get("max_copies", 64) > 0:
            return f"cycle: {s['copies']} copies of one unit (digits read alike)"
        return f"cycle: {s.get('repeat_chars', '?')} characters repeat every {s.get('period', '?')}"
    # what the ratio was compared with: zoomr's threshold scales with the window's fill, the paper's is constant
    limit = s.get("gzip_threshold") or detector.get("min_gzip_ratio")
    shown = f"{limit:.3f}" if isinstance(limit, (int, float)) else "?"
    return f"repetition: gzip {s['min_gzip_ratio']:.3f} < {shown}"


def detector_line(settings: dict) -> str:
    """Which detector the run's ``settings`` name: ``zoomr (calibrated)`` or ``paper (KV-Rescue as stated)``."""
    name = (settings.get("detector") or {}).get("name", "zoomr")
    return f"{name} ({DETECTOR_NOTES.get(name, 'custom')})"


DETECTOR_NOTES = {"zoomr": "calibrated", "paper": "KV-Rescue as stated"}


class PlainView:
    """``--no-live``: each committed step as plain text on stdout; models, aborts on stderr."""

    def __init__(self, out: Output):
        self.out = out
        self.detector: dict = {}

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, RunStarted):
            self.detector = ev.settings.get("detector", {})
            self.out.info(f"base: {ev.base}")
            self.out.info(f"helper: {ev.helper}")
            self.out.info(f"scorer: {ev.scorer}")
            self.out.info(f"detector: {detector_line(ev.settings)}")
            if ev.settings.get("early_exit") is False:
                self.out.info("degeneration detector off: no base candidate is aborted")
        elif isinstance(ev, CandidateAborted):
            self.out.info(f"step {ev.step + 1} candidate {ev.cand} ({ev.source}) aborted after {ev.tokens} tok: "
                          f"{abort_reason(ev, self.detector)}")
        elif isinstance(ev, StepCommitted):
            body = ev.text if ev.text.endswith("\n") else ev.text + "\n"
            self.out.token(f"[{step_header(ev)}]\n{body}")


class LiveView:
    """Rich live display on ``console``; use as a context manager around the run."""

    def __init__(self, console: Console):
        self.console = console
        self.lock = threading.Lock()   # the Live refresh thread renders while the loop updates
        self.rows: dict[int, dict] = {}
        self.step = 0
        self.committed = {"base": 0, "helper": 0}
        self.kv: dict[str, dict] = {}
        self.detector: dict = {}
        self.scorer = ""
        self.live: Live | None = None

    def __enter__(self) -> "LiveView":
        self.live = Live(self, console=self.console, refresh_per_second=8, transient=True)
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self.live.__exit__(*exc)
        return False

    def __call__(self, ev: Event) -> None:
        with self.lock:
            self._apply(ev)
        if isinstance(ev, StepCommitted):
            self._print_step(ev)
        elif isinstance(ev, RunStarted):
            off = "\ndetector off: no base candidate is aborted" if ev.settings.get("early_exit") is False else ""
            self.console.print(Text(f"base   {ev.base}\nhelper {ev.helper}\nscorer {ev.scorer}\n"
                                    f"detector {detector_line(ev.settings)}{off}", style="dim"))

    def _apply(self, ev: Event) -> None:
        if isinstance(ev, RunStarted):
            self.detector, self.scorer = ev.settings.get("detector", {}), ev.scorer
        elif isinstance(ev, CandidateStarted):
            if ev.step != self.step:
                self.step, self.rows = ev.step, {}
            self.rows[ev.cand] = {"source": ev.source, "n": 0, "H": 0.0, "gzip": 1.0, "text": "",
                                  "status": Text("sampling…", style="yellow")}
        elif isinstance(ev, CandidateToken):
            row = self.rows[ev.cand]
            row.update(n=ev.n, H=ev.mean_entropy, gzip=ev.gzip_ratio)
            row["text"] = (row["text"] + ev.text)[-400:]
        elif isinstance(ev, CandidateFinished):
            self.rows[ev.cand]["status"] = Text(STOP_LABEL.get(ev.stop_reason, ev.stop_reason))
        elif isinstance(ev, CandidateAborted):
            self.rows[ev.cand]["status"] = Text("✗ " + abort_reason(ev, self.detector), style="bold red")
        elif isinstance(ev, CandidateScored):
            self.rows[ev.cand]["status"] = Text(f"score {ev.score:.3f}")
        elif isinstance(ev, StepCommitted):
            self.committed[ev.source] += 1
            self.rows[ev.cand]["status"] = Text(f"★ committed ({ev.score:.3f})", style="bold green")
        elif isinstance(ev, KVSnapshot):
            self.kv[ev.role] = ev.stats

    def _print_step(self, ev: StepCommitted) -> None:
        style = SOURCE_STYLE.get(ev.source, "")
        self.console.print(Text(f"▌ {step_header(ev)}", style=f"bold {style}"))
        self.console.print(Text(ev.text.rstrip("\n") or "(empty step)"), Text(""))

    def __rich__(self) -> Group:
        with self.lock:
            total = sum(self.committed.values())
            share = f"{self.committed['helper'] / total:.0%}" if total else "–"
            kv = self.kv.get("base")
            kv_txt = f" · base KV {kv['active_tokens']}/{kv['full_tokens']} tok active/full" if kv else ""
            table = Table(title=f"KV-Rescue · step {self.step + 1} · committed {total} (helper {share}){kv_txt}",
                          title_justify="left", expand=True)
            for col, kw in (("#", {"width": 3}), ("source", {"width": 7}), ("tok", {"width": 5, "justify": "right"}),
                            ("H̄ nats", {"width": 7, "justify": "right"}), ("gzip", {"width": 6, "justify": "right"}),
                            ("status", {"ratio": 2}), ("text (tail)", {"ratio": 3, "no_wrap": True})):
                table.add_column(col, **kw)
            for i, r in sorted(self.rows.items()):
                tail = r["text"].replace("\n", "⏎")[-70:]
                table.add_row(str(i), Text(r["source"], style=SOURCE_STYLE.get(r["source"], "")), str(r["n"]),
                              f"{r['H']:.2f}", f"{r['gzip']:.2f}", r["status"].copy(), Text(tail))
            return Group(table, Text(f"scorer: {self.scorer}", style="dim"))
