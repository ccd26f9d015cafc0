"""The degeneration detector over the committed trajectory's tail (issue 29): loops across steps, loops that
outlast a step, and short units caught as early as the constant gzip threshold caught them."""

import pytest

from zoomr.rescue.degeneration import TAIL_LIMIT, DegenerationDetector, DetectorConfig, gzip_ratio, step_loop

UNIT = "The answer is 5.\n\n"
SENTENCE = "We add the two numbers to get the total. "   # 41 characters, no blank line
TABLE = "| x | x^2 |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(15))
ROW = "| 0 " * 10 + "|\n"
ZEROS = "| 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 |\n|" + "---|" * 10 + "\n" + ROW * 10  # rows repeat verbatim


def chunks(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def abort_at(pieces, history="", config=DetectorConfig()):
    """(index of the aborting piece or None, signals) for pieces fed after ``history``."""
    det = DegenerationDetector(config, history=history)
    for i, piece in enumerate(pieces):
        if det.observe(piece, 0.0).abort:
            return i, det.signals
    return None, det.signals


def test_a_fourth_copy_of_a_repeated_step_is_aborted():
    pieces = ["The", " answer", " is", " ", "5", ".", "\n\n"]
    at, s = abort_at(pieces, history=UNIT * 3)
    # aborted at the token that completes the copy: a candidate that starts alike and then differs is kept
    assert (at, s.abort, s.step_copies, s.period) == (len(pieces) - 1, "cycle", 3, len(UNIT))
    assert s.as_dict()["step_copies"] == 3 and s.repeat_chars >= 3 * len(UNIT)
    # the candidate alone (the detector before issue 29 saw nothing else), two committed copies, a
    # different number, the rule off: kept
    assert abort_at(pieces)[0] is None
    assert abort_at(pieces, history=UNIT * 2)[0] is None
    assert abort_at(["The", " answer", " is", " ", "6", ".", "\n\n"], history=UNIT * 3)[0] is None
    assert abort_at(pieces, history=UNIT * 3, config=DetectorConfig(step_copies=0))[0] is None


def test_a_cycle_of_two_steps_and_a_long_step_repeated():
    a, b = "First, 16 - 3 = 13.\n\n", "Then 13 - 4 = 9.\n\n"
    at, s = abort_at(chunks(a), history=(a + b) * 3)
    assert s.abort == "cycle" and at == len(chunks(a)) - 1 and s.period == len(a + b)
    assert abort_at(chunks(a), history=(a + b) * 2 + a + "Then 13 - 4 = 8.\n\n")[0] is None
    long = SENTENCE * 4 + "\n\n"   # 166 characters: aborted 64 characters into its fourth copy
    at, s = abort_at(list(long), history=long * 3)
    assert s.abort == "cycle" and at == 63 and s.step_copies == 3


def test_a_loop_that_outlasts_a_step_aborts_the_candidate_that_continues_it():
    committed = (SENTENCE * 80)[:1500]      # the step ran to its token limit mid-loop: no step end
    cont = (SENTENCE * 80)[1500:2500]
    at, s = abort_at(chunks(cont), history=committed)
    # the repeat runs back into the committed text: aborted once the candidate copied 64 characters of it
    assert s.abort == "cycle" and at == 64 // 3 and s.repeat_chars > 1000
    alone, _ = abort_at(chunks(cont))
    assert alone is not None and alone > 2 * at   # on its own, it has to repeat itself first


def test_a_compressible_committed_step_does_not_abort_the_next():
    """The gzip signal reads the candidate alone: a table before it must not make its first tokens a loop."""
    assert gzip_ratio(ZEROS) < 0.18
    for history in (TABLE + "\n\n", ZEROS + "\n\n", UNIT * 3):
        for cand in (ZEROS, TABLE, "So the sum of the squares is 1015, and we are done.\n\n"):
            assert abort_at(list(cand), history=history)[0] is None, (history[:20], cand[:20])


def test_short_units_are_caught_as_early_as_the_constant_threshold():
    """A sentence loop at one character per token: the constant τ_cmp caught it, the threshold scaled with the
    window's fill (issue 12) caught it later or, from about 34 characters of unit, not within 512 tokens."""
    for unit in ("So the answer is 12. ", SENTENCE, "Let me check the multiplication again carefully. "):
        loop = list((unit * 40)[:512])
        at, s = abort_at(loop)
        assert s.abort == "repetition" and s.gzip_threshold == 0.18
        constant = next(i for i in range(1, 513) if gzip_ratio("".join(loop[:i])) < 0.18)
        assert at == constant - 1, (unit, at, constant)
        scaled = next((i for i in range(1, 513) if gzip_ratio("".join(loop[:i])) < 0.18 * i / 800), None)
        assert scaled is None or scaled > constant + 30


def test_verbatim_rows_of_cells_keep_the_scaled_threshold():
    at, s = abort_at(list(ZEROS))
    assert at is None and s.period == len(ROW) and s.gzip_threshold < 0.18


def test_step_loop_reads_only_whole_steps_and_a_bounded_tail():
    text = UNIT * 3 + "The"
    assert step_loop(text, len(UNIT) * 3, "\n\n") == (3, 2 * len(UNIT) + 3, len(UNIT))
    assert step_loop(text, len(UNIT) * 3 - 1, "\n\n") == (0, 0, 0)   # not after a step end
    assert step_loop(UNIT * 3, len(UNIT) * 3, "\n\n") == (0, 0, 0)   # no candidate text yet
    det = DegenerationDetector(history="x" * (TAIL_LIMIT + 100) + UNIT * 3)
    for piece in chunks(UNIT):
        s = det.observe(piece, 0.0)
    assert s.abort == "cycle" and len(det._all) == TAIL_LIMIT


def test_bad_step_copies_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="step_copies"):
        DetectorConfig(step_copies=-1).validate()
