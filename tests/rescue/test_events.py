"""One event bus (:class:`zoomr.kvstore.events.EventBus`) for KV-policy recomputes and KV-Rescue's events.

Both kinds derive from :class:`zoomr.kvstore.events.Event`, so one subscriber (a ``--json`` transcript, a
live view) takes either; each event's JSON is ``{"event": kind, **fields}``, fields in declaration order.
"""

import json

from zoomr.kvstore.events import Event, EventBus, RecomputeEvent
from zoomr.rescue.events import CandidateToken, RunFinished, RunStarted
from zoomr.rescue.transcript import Transcript


def test_one_bus_delivers_both_kinds_in_subscription_order():
    order, seen, tr = [], [], Transcript()
    bus = EventBus(lambda ev: order.append("first"), seen.append)   # given at construction: called first
    bus.subscribe(tr)
    bus.subscribe(lambda ev: order.append("last"))
    started = RunStarted("q", "base model", "helper model", "scorer", {}, {"base": 3, "helper": 3})
    recompute = RecomputeEvent("zoomr", 120, [3], [1, 2], {1: 2, 3: 5}, 0.8, 40, 3, "auto")
    finished = RunFinished("42", "eos", 0, 1.5)
    for ev in (started, recompute, finished):
        bus.emit(ev)
    assert seen == [started, recompute, finished] and all(isinstance(ev, Event) for ev in seen)
    assert order == ["first", "last"] * 3
    # the transcript takes a policy's event as it takes the loop's: recorded in its place, the summary unchanged
    assert [e["event"] for e in tr.events] == ["run_started", "recompute", "run_finished"]
    assert tr.summary()["answer"] == "42" and tr.summary()["stop_reason"] == "eos"


def test_event_json_is_its_kind_then_its_fields():
    token = CandidateToken(0, 1, "base", 42, "x", 3, 1.25, 1.5, 0.5, 10, 20, 30, 40)
    assert json.dumps(token.as_dict()) == (
        '{"event": "token", "step": 0, "cand": 1, "source": "base", "token": 42, "text": "x", "n": 3, '
        '"entropy": 1.25, "mean_entropy": 1.5, "gzip_ratio": 0.5, "active_tokens": 10, "active_bytes": 20, '
        '"full_tokens": 30, "full_bytes": 40}')
    assert json.dumps(RunFinished(None, "interrupted", 2, 0.25).as_dict()) == \
        '{"event": "run_finished", "answer": null, "stop_reason": "interrupted", "steps": 2, "seconds": 0.25}'
    recompute = RecomputeEvent("zoomr", 120, [3, 5], [1, 2], {1: 2, 3: 9}, 0.8, 180, 6, "auto")
    assert json.dumps(recompute.as_dict()) == (
        '{"event": "recompute", "policy": "zoomr", "position": 120, "zoomed": [3, 5], "summaries": [1, 2], '
        '"votes": {"1": 2, "3": 9}, "agreeability": 0.8, "active_tokens": 180, "segments": 6, '
        '"summaries_mode": "auto"}')
    # the dict is a copy: changing it leaves the emitted event as it was
    recompute.as_dict()["zoomed"].append(7)
    assert recompute.zoomed == [3, 5]
