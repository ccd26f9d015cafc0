"""A trajectory that repeats one step (issue 29), through the real KV-Rescue loop on the embedded model.

The prompt is the step written ten times, so the embedded model goes on writing it: the loop commits it
step after step until the detector, which reads the committed steps before each candidate, aborts the
base candidates that would write it a fourth time. The helper's candidates are not screened (the paper's
fallback that keeps the pool non-empty): they carry the trajectory on.
"""

import pytest

from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.rescue.degeneration import DetectorConfig
from zoomr.rescue.engine import Engine
from zoomr.kvstore.events import EventBus
from zoomr.rescue.loop import RescueConfig, RescueLoop
from zoomr.rescue.scorers import HelperLikelihoodScorer
from zoomr.rescue.transcript import Transcript

pytestmark = pytest.mark.usefixtures("one_torch_thread")

UNIT = "The answer is 5.\n\n"


def run_loop(backend, batched: bool, detector: DetectorConfig = DetectorConfig()) -> Transcript:
    """N_b 2, N_h 1, five steps of at most 12 tokens, the base and the helper on the embedded model; top-k 1,
    so every candidate writes what the model is surest of."""
    events, tr = EventBus(), Transcript()
    events.subscribe(tr)
    loop = RescueLoop(Engine("base", backend), Engine("helper", backend), HelperLikelihoodScorer(),
                      Sampler(SamplingParams(0.8, 1, 0.95, 0)),
                      RescueConfig(2, 1, 12, 5, 2048, detector=detector, batched=batched), events)
    ids = backend.tokenizer.encode(UNIT * 10, special=False)
    try:
        loop.run("What is the answer?", ids, ids)
    finally:
        loop.close()
    return tr


def by_step(tr: Transcript, kind: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in tr.events:
        if e["event"] == kind:
            out.setdefault(e["step"], []).append(e)
    return out


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "sequential"])
@pytest.mark.slow
def test_the_fourth_copy_of_a_step_is_aborted_in_the_base(torch_backend, batched):
    tr = run_loop(torch_backend, batched)
    committed = [e for e in tr.events if e["event"] == "step_committed"]
    aborted = by_step(tr, "candidate_aborted")
    # the model does repeat the step: three copies are committed (the first after a "\n": the prompt's
    # last step end is tokenized apart from the next word), no candidate aborted on the way
    assert [e["text"] for e in committed[:3]] == ["\n" + UNIT, UNIT, UNIT]
    assert not any(s < 3 for s in aborted)
    # from the fourth step on, every base candidate is aborted once it has written the step again
    for step in (3, 4):
        assert sorted(e["cand"] for e in aborted[step]) == [0, 1]
        for e in aborted[step]:
            assert e["reason"] == "cycle" and e["text"] == UNIT and e["signals"]["step_copies"] >= 3
        assert committed[step]["source"] == "helper" and committed[step]["text"] == UNIT


@pytest.mark.slow
def test_without_the_step_rule_the_loop_goes_on_in_the_base(torch_backend):
    """The same run with the rule off: the detector, reset for every candidate, sees a short step alone."""
    tr = run_loop(torch_backend, True, DetectorConfig(step_copies=0))
    committed = [e for e in tr.events if e["event"] == "step_committed"]
    assert [e["text"] for e in committed] == ["\n" + UNIT] + [UNIT] * 4 and not by_step(tr, "candidate_aborted")
