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
    scorer, seconds.
"""

from __future__ import annotations

from .events import (CandidateAborted, CandidateStarted, CandidateToken, Event, KVSnapshot, RunFinished,
                     RunStarted, StepCommitted)


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
        self.start: RunStarted | None = None
        self.finish: RunFinished | None = None

    def __call__(self, ev: Event) -> None:
        self.events.append(ev.as_dict())
        if isinstance(ev, CandidateToken):
            self.tokens[ev.source] += 1
        elif isinstance(ev, CandidateStarted):
            self.candidates[ev.source] += 1
        elif isinstance(ev, CandidateAborted):
            self.aborts.append({"step": ev.step, "cand": ev.cand, "reason": ev.reason, "signals": ev.signals})
        elif isinstance(ev, StepCommitted):
            self.steps.append({"source": ev.source, "score": ev.score, "text": ev.text, "tokens": ev.tokens})
            for role, n in ev.rebase.items():
                self.prefill[role] += n
        elif isinstance(ev, KVSnapshot):
            self.kv[ev.role] = ev.stats
        elif isinstance(ev, RunStarted):
            self.start = ev
            for role, n in ev.prompt_tokens.items():
                self.prefill[role] += n
            self.kv.update(ev.kv)  # replaced at each commit; stays when no step is ever committed
        elif isinstance(ev, RunFinished):
            self.finish = ev

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
            "scorer": self.start.scorer if self.start else None,
            "seconds": self.finish.seconds if self.finish else None,
        }

    def record(self, problem: str) -> dict:
        """The whole JSON document: the problem, the models, the summary fields, then every event."""
        head = {"mode": "rescue", "problem": problem}
        if self.start:
            head.update(base=self.start.base, helper=self.start.helper, settings=self.start.settings)
        return {**head, **self.summary(), "events": self.events}
