"""SumR on llama.cpp: closed segments keep only their summaries, evicted with seq_rm (holes, positions as written)."""

import numpy as np
import pytest

from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.models import resolve_model
from zoomr.kvstore.segments import BEGIN, END

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
PARAGRAPHS = ("First we count the clips sold in April: Natalia sold 48 clips to her friends that month.\n\n"
              "Next we look at May, when she sold half as many clips as in April, so 48 / 2 = 24 clips.\n\n"
              "Then we add both months together to get the total: 48 + 24 = 72 clips in all.\n\n"
              "So the answer is 72.")
SUMMARIZED = (f"April: Natalia sold 48 clips to her friends in that month, as the problem says. "
              f"{BEGIN}48 in April{END} May: she sold half as many, which is 48 / 2 = 24 clips. "
              f"{BEGIN}24 in May{END} Total: 48 + 24 = 72.")


@pytest.fixture
def sumr():
    """Builds sumr backends (-c 256) and closes them after the test."""
    made = []

    def make(summaries: str, window: int, segment_tokens: int = 96) -> LlamaCppBackend:
        made.append(LlamaCppBackend(resolve_model(None), n_ctx=256, threads=1, policy="sumr", window=window,
                                    summaries=summaries, segment_tokens=segment_tokens, max_sequences=3))
        return made[-1]

    yield make
    for b in made:
        b.close()


def teacher_force(be, seq, text: str) -> list[int]:
    """Decode ``text`` token by token as if the model wrote it; returns the ids."""
    ids = be.tokenizer.encode(text, special=False)
    for t in ids:
        assert np.isfinite(be.decode(seq, t)).all()
    return ids


def check_resident(be, seq, written: list[int]) -> None:
    """llama.cpp holds exactly zoomr's cells, at the positions they were written at (evictions leave holes, as on
    the torch backend), with the right ids; the prompt and every closed segment's summary are resident; the rest
    of each closed segment, before the window, is not. Valid right after a recompute (text ending at a semantic
    boundary)."""
    pol = seq.policy
    assert be.cells_held(seq) == seq.n_written - seq.origin[0]   # llama.cpp's span: first to last position
    assert seq.origin[-1] == seq.n_written - 1 and seq.next_position == seq.n_written
    if seq.evicted_tokens:
        assert len(seq.tokens) < seq.n_written   # the holes are real: fewer cells than positions
    assert seq.tokens == [written[p] for p in seq.origin]
    resident = set(seq.origin)
    assert set(range(pol.n_prompt)) <= resident
    cut = min(pol.end - pol.window, pol.tracker.open_start)
    for s in pol.tracker.segments:
        assert set(s.summary) <= resident
        assert not {p for p in s.regular if p < cut and p not in s.summary} & resident


def test_paragraph_segments_are_evicted_to_their_stand_ins(sumr):
    be = sumr("auto", 32, 32)  # paragraphs (11..32 tokens: --segment-tokens 32) make the segments
    seq = be.new_sequence()
    written = be.tokenizer.encode(PROMPT, special=False)
    be.prefill(seq, written)
    written += teacher_force(be, seq, PARAGRAPHS)
    st = be.kv_stats(seq)
    assert st.extra["summaries_mode"] == "paragraphs" and st.extra["segments"] == 3
    assert st.extra["recomputes"] > 0 and st.extra["evicted_tokens"] > 0
    check_resident(be, seq, written)
    assert st.active_tokens < st.full_tokens
    be.free(seq)


def test_delimited_summaries_stay_and_their_reasoning_goes(sumr):
    be = sumr("model", 8)  # only the written summaries make segments
    seq = be.new_sequence()
    written = be.tokenizer.encode(PROMPT, special=False)
    be.prefill(seq, written)
    half = SUMMARIZED.index(" May:")
    written += teacher_force(be, seq, SUMMARIZED[:half])
    child = be.fork(seq)  # the fork continues on its own tracker
    written_child = written + teacher_force(be, child, " Let us stop here.")
    written += teacher_force(be, seq, SUMMARIZED[half:])
    segs = seq.policy.tracker.segments
    assert [s.kind for s in segs] == ["model", "model"]
    assert [be.tokenizer.decode([written[p] for p in s.summary]) for s in segs] == [
        f" {BEGIN}48 in April{END}", f" {BEGIN}24 in May{END}"]
    check_resident(be, seq, written)
    check_resident(be, child, written_child)
    assert len(child.policy.tracker.segments) == 1
    for s in (child, seq):
        be.free(s)


def test_a_default_window_past_the_context_says_what_to_change():
    # sumr's default --window (512) with -c 256: the message names both numbers and both ways out
    from zoomr.backends.llamacpp.sumr import SumRCells
    from zoomr.kvstore.sumr import SumRConfig

    with pytest.raises(ValueError) as e:
        SumRCells(256, SumRConfig().window)
    assert str(e.value) == ("sumr: --window 512 must be between 1 and 255 tokens (below -c 256); "
                            "pass a smaller --window or a larger -c")
