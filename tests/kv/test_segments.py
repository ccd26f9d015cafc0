"""Segment tracker: delimiters across tokens, paragraphs, cuts, modes, semantic boundaries."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoomr.kvstore.segments import (BEGIN, END, LINE_EDGE, NO_EDGE, PARAGRAPH_EDGE, SENTENCE_EDGE, SegmentTracker,
                                    edge_strength, ends_at_boundary, stand_in)


def feed(tracker, pieces, start=100):
    closed = []
    for i, text in enumerate(pieces):
        closed += tracker.push(start + i, text)
    return closed


def test_delimiters_split_over_tokens_make_model_segments():
    pieces = ["We", " add", " 2", ".", " <|begin", "_of_sum", "mary|> add", " two", " <|end_of", "_summary|>",
              " Then", " x", "<|begin_of_summary|>", "s", "<|end_of_summary|>", "tail"]
    t = SegmentTracker("model")
    segs = feed(t, pieces)
    assert [s.kind for s in segs] == ["model", "model"]
    first, second = segs
    assert first.regular == range(100, 104) and first.text == "We add 2."
    assert first.summary == tuple(range(104, 110))          # delimiter tokens included
    assert second.regular == range(110, 112) and second.summary == (112, 113, 114)
    assert set(first.key_positions) == set(first.summary)
    assert t.open_start == 115 and t.mode_ran() == "model" and not t.in_summary


def test_summary_right_after_summary_has_empty_regular_segment():
    t = SegmentTracker("model")
    segs = feed(t, [BEGIN, "a", END, BEGIN, "b", END])
    assert [s.regular for s in segs] == [range(0), range(0)] and segs[1].summary == (103, 104, 105)


def test_model_mode_never_splits_paragraphs():
    t = SegmentTracker("model", max_segment=4)
    assert feed(t, ["a", "\n\n", "b", "c", "d", "e", "\n\n"]) == []
    assert t.mode_ran() == "none" and t.open_start == 100


def test_auto_paragraphs_stand_ins_and_double_newline_across_tokens():
    t = SegmentTracker("auto", max_segment=64, min_segment=1)
    segs = feed(t, ["First", " step", ".", "\n", "\n", "Second", " one", ":", " done", "\n\n"])
    assert [s.regular for s in segs] == [range(100, 105), range(105, 110)]
    assert segs[0].summary == (100, 101, 103, 104)          # m = 4: first 2 + last 2
    assert set(segs[0].key_positions) == set(range(100, 105))
    assert t.mode_ran() == "paragraphs"


def test_whitespace_only_paragraph_stays_open():
    t = SegmentTracker("auto", min_segment=1)
    assert feed(t, ["\n\n", "\n\n"]) == []
    assert [s.regular for s in feed(t, ["x", "\n\n"], start=102)] == [range(100, 104)]


def test_long_paragraph_is_cut_at_its_last_line_break():
    t = SegmentTracker("auto", max_segment=6)
    segs = feed(t, ["a", "b", "\n", "c", "d", "e"])
    assert [s.regular for s in segs] == [range(100, 103)]
    assert t.open_start == 103
    segs = feed(t, ["f", "g", "h"], start=106)           # no line break: hard cut at 6 tokens
    assert [s.regular for s in segs] == [range(103, 109)]


def test_auto_switches_to_model_summaries_once_a_delimiter_appears():
    t = SegmentTracker("auto", max_segment=100, min_segment=1)
    segs = feed(t, ["p", "\n\n", "q", BEGIN, "s", END, "r", "\n\n", "x"])
    assert [s.kind for s in segs] == ["paragraph", "model"]
    assert t.mode_ran() == "paragraphs, then model" and t.open_start == 106


def test_multi_token_push_keeps_its_edges():
    t = SegmentTracker("model")
    segs = t.push(0, "intro " + BEGIN + " sum " + END, n=5) + t.push(5, "more")
    assert segs and segs[0].summary == (0, 1, 2, 3, 4) and segs[0].regular == range(0)


@pytest.mark.parametrize("bad", [lambda: SegmentTracker("bogus"), lambda: SegmentTracker("auto", 0),
                                 lambda: SegmentTracker("auto", 8, 9), lambda: SegmentTracker("auto", 8, 0),
                                 lambda: SegmentTracker().push(0, "x", n=0)])
def test_bad_arguments_raise_value_error(bad):
    with pytest.raises(ValueError):
        bad()


def test_out_of_order_push_raises():
    t = SegmentTracker()
    t.push(10, "a")
    with pytest.raises(ValueError, match="in order"):
        t.push(12, "b")


@pytest.mark.parametrize("text,expected", [("x.", True), ("x!", True), ("so?", True), ("wait...", True),
                                           ("so:", True), ("a\n\n", True), ("a\n\n\n", True), ("x. ", True),
                                           ("a\n", False), ("3", False), ("x,", False), ("", False)])
def test_semantic_boundaries(text, expected):
    assert ends_at_boundary(text) is expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", " b", ".", "\n", "\n\n", "<|begin", "_of_summary|>", BEGIN, END, "<|end_of_",
                                 "summary|>", " "]), max_size=80),
       st.sampled_from(["auto", "model", "prompted"]), st.integers(1, 12))
def test_segments_partition_the_stream(pieces, mode, max_segment):
    t = SegmentTracker(mode, max_segment)
    segs = feed(t, pieces, start=0)
    covered = []
    for s in segs:
        covered += list(s.regular)
        if s.kind == "model":
            covered += list(s.summary)
        else:
            assert set(s.summary) <= set(s.regular) and len(s.summary) == len(stand_in(s.regular))
    # closed segments tile the positions before the open one, in order, without overlap
    assert covered == list(range(len(covered)))
    assert t.open_start is None or t.open_start == len(covered)
    assert [s.index for s in segs] == list(range(len(segs)))


# --- bounded blocks (auto/prompted on a model that writes no summaries) -----------------------------------

WORDS = ["We", " add", " 3", ".", "5", " x", ",", " =", ".", "!", ":", " ", "\n", "\n\n", " so", "?", "\\]"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(WORDS), max_size=300), st.integers(1, 40), st.integers(0, 40),
       st.sampled_from(["auto", "prompted"]))
def test_every_closed_block_lies_within_the_bounds(pieces, hi, lo_extra, mode):
    lo = max(1, hi - lo_extra)
    t = SegmentTracker(mode, max_segment=hi, min_segment=lo)
    segs = feed(t, pieces, start=0)
    for s in segs:
        assert lo <= len(s.regular) <= hi, (lo, hi, s.text)
    # the open rest is shorter than the longest block (it would have been cut)
    assert t.open_start is None or len(pieces) - t.open_start < hi


def test_text_without_paragraphs_still_makes_blocks_and_defaults_to_a_third():
    t = SegmentTracker("auto", max_segment=96)
    assert t.min_segment == 32
    segs = feed(t, ["w"] * 500, start=0)                   # no boundary at all: hard cuts at 96 tokens
    assert [len(s.regular) for s in segs] == [96] * 5 and t.mode_ran() == "paragraphs"


def test_a_paragraph_closes_once_it_holds_min_tokens_and_shorter_ones_merge():
    t = SegmentTracker("auto", max_segment=12, min_segment=4)
    segs = feed(t, ["a", "b", "\n\n", "c", "d", "e", "\n", "\n", "f"])
    assert [s.regular for s in segs] == [range(100, 108)]     # "ab\n\n" was too short: merged into the next


def test_a_full_block_is_cut_at_a_sentence_end_before_a_later_line_end():
    t = SegmentTracker("auto", max_segment=12, min_segment=4)
    segs = feed(t, ["w"] * 4 + [".", " w", " w", "\n"] + ["w"] * 4)
    assert [s.regular for s in segs] == [range(100, 105)] and segs[0].text == "wwww."
    assert t.open_start == 105


def test_a_full_block_is_cut_at_its_last_line_end_when_no_sentence_ends():
    t = SegmentTracker("auto", max_segment=10, min_segment=3)
    segs = feed(t, ["a", "\n", "b", "c", "\n", "d", "e", "f", "g", "h"])
    assert [s.regular for s in segs] == [range(100, 105)]


def test_a_decimal_point_is_no_sentence_end_and_a_short_edge_is_not_eligible():
    t = SegmentTracker("auto", max_segment=8, min_segment=3)
    # "3.5" has no white space after the point; the sentence end after "x." is 2 tokens in (< min)
    segs = feed(t, ["x", ".", " 3", ".", "5", " y", " z", " w"])
    assert [s.regular for s in segs] == [range(100, 108)]     # a hard cut at 8


@pytest.mark.parametrize("left,right,want", [("a\n", "\n", PARAGRAPH_EDGE), ("a.\n\n", "b", PARAGRAPH_EDGE),
                                             ("so.", " b", SENTENCE_EDGE), ("so:", "\n", SENTENCE_EDGE),
                                             ("3.", "5", NO_EDGE), ("x", "\n", LINE_EDGE), ("x", " y", NO_EDGE),
                                             ("", "", NO_EDGE)])
def test_edge_strength(left, right, want):
    assert edge_strength(left, right) == want


# --- content-only mean keys of delimited summaries when the model is not fine-tuned -------------------------

SUMMARIZED = ["We", " add", ".", " <|begin", "_of_sum", "mary|>", " two", " things", " <|end_of", "_summary|>"]


@pytest.mark.parametrize("mode", ["prompted", "auto"])
def test_plain_text_delimiters_are_left_out_of_the_summary_mean(mode):
    (seg,) = feed(SegmentTracker(mode), SUMMARIZED)
    assert seg.summary == tuple(range(103, 110))              # attended: delimiters included
    assert seg.content == (106, 107) and seg.key_positions == (106, 107)


def test_a_token_straddling_a_delimiter_edge_counts_as_content():
    (seg,) = feed(SegmentTracker("prompted"), ["x", BEGIN[:-2], "|> two", " <|end_of_summary|>"])
    assert seg.content == (102,)


def test_model_mode_averages_the_whole_summary():
    (seg,) = feed(SegmentTracker("model"), SUMMARIZED)
    assert seg.content is None and seg.key_positions == tuple(range(103, 110))
