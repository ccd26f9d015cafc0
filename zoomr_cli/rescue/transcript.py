"""The ``--json`` record of a KV-Rescue run, built only from the event stream.

Because the summary is derived from the same events the live view shows, the numbers in the JSON
and on screen cannot disagree, and an interrupted run still yields a record of what was committed.

Summary fields (tokens are in each model's own vocabulary):
    answer, stop_reason, steps [{source, score, text, tokens}], helper_share (committed steps from
    the helper / all), candidates {base, helper} (sampled), base_tokens / helper_tokens (sampled by
    that role's candidates, winners or not: the paper's "base-model token generation"),
    prefill_tokens {base, helper} (prompt + re-base prefills), aborted (base candidates stopped by
    the detector), aborted_by_reason, aborts [{step, cand, reason, signals}], kv {base, helper}
    (KVStats of the committed states at the last commit; after the prompt if nothing was committed),
    kv_trajectory {base, helper} (see :meth:`Transcript.trajectory_kv`), scorer, detector (``zoomr`` or
    ``paper``: which degeneration detector read the base candidates), seconds.
"""

from __future__ import annotations

from zoomr.kvstore.events import Event
from zoomr.rescue.events import (
    CandidateAborted,
    CandidateStarted,
    CandidateToken,
    KVSnapshot,
    RunFinished,
    RunStarted,
    StepCommitted,
)


class Transcript:
    """Subscriber that keeps every event (as dicts) and the running summary."""

    def __init__(self):
        self.events: list[dict] = []
        self.steps: list[dict] = []
        self.tokens = {"base": 0, "helper": 0}
        self.candidates = {"base": 0, "helper": 0}
        self.prefill = {"base": 0, "helper": 0}
        self.aborts: list[dict] = []
        self.kv: dict[str, dict] = {}
        # per role, one (active_tokens, active_bytes, full_tokens, full_bytes) per committed token
        self.kv_series: dict[str, list[tuple[int, int, int, int]]] = {"base": [], "helper": []}
        self._cand_kv: dict[int, list[tuple[int, int, int, int]]] = {}   # this step's candidates, by index
        self._won: list[tuple[int, int, int, int]] = []   # the last winner's readings, until its snapshot
        self._to_prefill = {"base": 0, "helper": 0}   # tokens of the last commit the role prefilled
        self.start: RunStarted | None = None
        self.finish: RunFinished | None = None

    def __call__(self, ev: Event) -> None:
        self.events.append(ev.as_dict())
        if isinstance(ev, CandidateToken):
            self.tokens[ev.source] += 1
            self._cand_kv[ev.cand].append((ev.active_tokens, ev.active_bytes, ev.full_tokens, ev.full_bytes))
        elif isinstance(ev, CandidateStarted):
            self.candidates[ev.source] += 1
            self._cand_kv[ev.cand] = []
        elif isinstance(ev, CandidateAborted):
            self.aborts.append({"step": ev.step, "cand": ev.cand, "reason": ev.reason, "signals": ev.signals})
        elif isinstance(ev, StepCommitted):
            self.steps.append({"source": ev.source, "score": ev.score, "text": ev.text, "tokens": ev.tokens})
            for role, n in ev.rebase.items():
                self.prefill[role] += n
                self._to_prefill[role] = n
            self._won = self._cand_kv[ev.cand]
            self._cand_kv = {}
        elif isinstance(ev, KVSnapshot):
            self.kv[ev.role] = ev.stats
            k = ev.stats
            now = (k["active_tokens"], k["active_bytes"], k["full_tokens"], k["full_bytes"])
            if ev.role == self._last_source():
                # a token's reading is the forward before it; the forward that wrote it is the next reading,
                # and for the step's last token the committed state's own (this snapshot)
                self.kv_series[ev.role] += self._won[1:] + [now] if self._won else []
                self._won = []
            else:  # one prefill forward wrote the other model's whole step
                self.kv_series[ev.role] += [now] * self._to_prefill[ev.role]
                self._to_prefill[ev.role] = 0
        elif isinstance(ev, RunStarted):
            self.start = ev
            for role, n in ev.prompt_tokens.items():
                self.prefill[role] += n
            self.kv.update(ev.kv)  # replaced at each commit; stays when no step is ever committed
        elif isinstance(ev, RunFinished):
            self.finish = ev

    def _last_source(self) -> str | None:
        return self.steps[-1]["source"] if self.steps else None

    def trajectory_kv(self, role: str) -> dict:
        """One model's KV time-averaged over the committed trajectory, one sample per committed token.

        Each committed token counts at the forward that wrote its KV: the decode step of a token the
        model sampled itself, the one prefill forward that took in the other model's step (all of the
        step at once: the most that forward held, so memory is never under-counted). The prompt's
        prefill is not a sample (as for single-sample runs, decode steps are averaged); with no
        committed token the means are the prompt state's values. Aborted and losing candidates are not
        part of the trajectory.

        Returns:
            {tokens (samples), mean_active_tokens (tokens), mean_active_bytes, mean_full_bytes (bytes),
            peak_active_tokens (tokens, of the committed state: prompt prefill included)}; {} before
            the run started.
        """
        series = self.kv_series[role]
        last = self.kv.get(role)
        if last is None:
            return {}
        if not series:
            series = [(last["active_tokens"], last["active_bytes"], last["full_tokens"], last["full_bytes"])]
        n = len(series)
        return {"tokens": len(self.kv_series[role]),
                "mean_active_tokens": round(sum(s[0] for s in series) / n, 2),
                "mean_active_bytes": round(sum(s[1] for s in series) / n),
                "mean_full_bytes": round(sum(s[3] for s in series) / n),
                "peak_active_tokens": last["peak_active_tokens"]}

    @property
    def detector(self) -> str | None:
        """Which degeneration detector ran (``zoomr`` or ``paper``, :mod:`zoomr.rescue.detectors`), from the
        run's settings; None before the run started or for settings that do not name one."""
        found = self.start.settings.get("detector") if self.start else None
        return found.get("name") if isinstance(found, dict) else None

    def summary(self) -> dict:
        """The summary fields listed in the module docstring."""
        by_reason: dict[str, int] = {}
        for a in self.aborts:
            by_reason[a["reason"]] = by_reason.get(a["reason"], 0) + 1
        helper_steps = sum(s["source"] == "helper" for s in self.steps)
        return {
            "answer": self.finish.answer if self.finish else None,
            "stop_reason": self.finish.stop_reason if self.finish else "interrupted",
            "steps": self.steps,
            "helper_share": round(helper_steps / len(self.steps), 4) if self.steps else 0.0,
            "candidates": dict(self.candidates),
            "base_tokens": self.tokens["base"],
            "helper_tokens": self.tokens["helper"],
            "prefill_tokens": dict(self.prefill),
            "aborted": len(self.aborts),
            "aborted_by_reason": by_reason,
            "aborts": self.aborts,
            "kv": self.kv,
            "kv_trajectory": {role: self.trajectory_kv(role) for role in self.kv},
            "scorer": self.start.scorer if self.start else None,
            "detector": self.detector,
            "seconds": self.finish.seconds if self.finish else None,
        }

    def record(self, problem: str) -> dict:
        """The whole JSON document: the problem, the models, the summary fields, then every event."""
        head = {"mode": "rescue", "problem": problem}
        if self.start:
            head.update(base=self.start.base, helper=self.start.helper, settings=self.start.settings)
        return {**head, **self.summary(), "events": self.events}
