"""``--detector paper``: KV-Rescue's degeneration detector as the paper states it, beside zoomr's calibrated one.

The paper (arXiv:2608.15797, "Implementation details"): mean entropy > 7.0 over 12 tokens after a 24-token
guard, or minimum gzip ratio < 0.18 over 800 characters; nothing else.
"""

import numpy as np
import pytest

from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.kvstore.events import EventBus
from zoomr.rescue.degeneration import DegenerationDetector, DetectorConfig, gzip_ratio
from zoomr.rescue.detectors import DETECTORS, check_detector, make_detector
from zoomr.rescue.engine import Engine
from zoomr.rescue.loop import RescueConfig, RescueLoop
from zoomr.rescue.paper_detector import PAPER, PaperDetector
from zoomr.rescue.scorers import HelperLikelihoodScorer
from zoomr.rescue.transcript import Transcript

UNIT = "The answer is 5.\n\n"
SUM = "1" + " + 1" * 59 + " = 60"   # 1 + 1 + ⋯ + 1 with 60 terms: a legitimate short step zoomr keeps


def feed(det, pieces, entropy=0.0):
    """(index of the aborting piece or None, signals)."""
    for i, piece in enumerate(pieces):
        if det.observe(piece, entropy).abort:
            return i, det.signals
    return None, det.signals


def test_the_papers_thresholds_and_windows():
    assert (PAPER.name, PAPER.max_entropy, PAPER.entropy_window, PAPER.entropy_guard, PAPER.min_gzip_ratio,
            PAPER.gzip_window) == ("paper", 7.0, 12, 24, 0.18, 800)
    assert PaperDetector().config == PAPER


def test_entropy_aborts_after_the_24_token_guard_only():
    flat = np.zeros(5000, dtype=np.float32)          # entropy log 5000 = 8.5 nats > 7.0
    det = PaperDetector()
    for n in range(1, 24):
        assert det.push("", flat).abort is None, n
    s = det.push("", flat)
    assert s.abort == "entropy" and s.tokens == 24 and s.mean_entropy == pytest.approx(np.log(5000), rel=1e-6)
    # below τ_ent nothing is aborted, however long
    calm = PaperDetector()
    assert all(calm.push("", np.zeros(1000, dtype=np.float32)).abort is None for _ in range(100))   # 6.9 nats


def test_the_gzip_threshold_is_constant_at_every_fill():
    # one character per token: aborted at the first window whose ratio is under 0.18, as soon as gzip allows
    text = "a" * 400
    at, s = feed(PaperDetector(), list(text))
    first = next(n for n in range(1, 401) if gzip_ratio(text[:n]) < 0.18)
    assert (at + 1, s.abort, s.gzip_threshold) == (first, "repetition", 0.18)
    assert first >= 112                                  # a gzip stream is never under 20 bytes: 20 / 112 < 0.18
    # zoomr's calibrated detector scales the threshold with the window's fill, so it waits much longer
    zoomr_at, zs = feed(DegenerationDetector(DetectorConfig(repeat_chars=0, max_copies=0)), list(text))
    assert zs.abort == "repetition" and zoomr_at > at


def test_a_short_legitimate_repetitive_step_aborted_by_the_paper_kept_by_zoomr():
    pieces = [SUM[i:i + 4] for i in range(0, len(SUM), 4)]
    assert gzip_ratio(SUM) < 0.18
    assert feed(PaperDetector(), pieces)[1].abort == "repetition"
    assert feed(DegenerationDetector(), pieces)[0] is None


def test_the_paper_reads_only_the_candidate():
    pieces = ["The", " answer", " is", " ", "5", ".", "\n\n"]
    # zoomr's reads the committed steps: a fourth copy of a step is a loop; the paper's sees one short step
    assert feed(DegenerationDetector(history=UNIT * 3), pieces)[1].abort == "cycle"
    at, s = feed(PaperDetector(PAPER, history=UNIT * 3), pieces)
    assert at is None and (s.repeat_chars, s.period, s.copies, s.step_copies) == (0, 0, 0, 0)


def test_the_registry_builds_the_named_detector():
    assert set(DETECTORS) == {"zoomr", "paper"}
    assert type(make_detector(DetectorConfig())) is DegenerationDetector
    assert type(make_detector(DetectorConfig(name="paper"))) is PaperDetector
    with pytest.raises(ValueError, match=r"^--detector 'gzip' unknown \(choose from zoomr, paper\)$"):
        check_detector("gzip")
    with pytest.raises(ValueError, match="--detector 'gzip' unknown"):
        RescueConfig(detector=DetectorConfig(name="gzip")).validate()


def test_settings_name_the_detector_and_only_the_thresholds_it_reads():
    paper = RescueConfig(detector=PAPER).as_dict()["detector"]
    assert paper == {"max_entropy": 7.0, "entropy_window": 12, "entropy_guard": 24, "min_gzip_ratio": 0.18,
                     "gzip_window": 800, "name": "paper"}
    zoomr = RescueConfig().as_dict()["detector"]
    assert zoomr["name"] == "zoomr" and (zoomr["repeat_chars"], zoomr["max_copies"], zoomr["step_copies"]) == (256, 64, 3)


@pytest.mark.slow
def test_the_loop_runs_the_papers_detector_and_records_it(torch_backend, one_torch_thread):
    """The trajectory of tests/rescue/test_rescue_step_loop.py, whose fourth copy of a step zoomr's detector
    aborts in the base: the paper's reads only each short candidate, so no candidate is aborted."""
    events, tr = EventBus(), Transcript()
    events.subscribe(tr)
    loop = RescueLoop(Engine("base", torch_backend), Engine("helper", torch_backend), HelperLikelihoodScorer(),
                      Sampler(SamplingParams(0.8, 1, 0.95, 0)),
                      RescueConfig(2, 1, 12, 5, 2048, detector=PAPER), events)
    ids = torch_backend.tokenizer.encode(UNIT * 10, special=False)
    try:
        loop.run("What is the answer?", ids, ids)
    finally:
        loop.close()
    rec = tr.record("What is the answer?")
    assert rec["detector"] == "paper" and rec["settings"]["detector"]["name"] == "paper"
    committed = [e["text"] for e in tr.events if e["event"] == "step_committed"]
    assert len(committed) == 5 and committed[1:] == [UNIT] * 4     # the loop zoomr's detector stops at step 4
    assert rec["aborted"] == 0 and rec["candidates"]["base"] == 10
