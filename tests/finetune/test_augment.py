"""Summary augmentation (ZoomR §3.2): paragraph split, summary rejection and fallback, delimiter insertion."""

import json

import pytest

from zoomr.errors import UserError
from zoomr.finetune.augment import (augment_trace, check_summary, clean_solution, clean_summary, detect_fields,
                                    fallback_summary, insert_summaries, read_traces, split_augmented,
                                    split_paragraphs)
from zoomr.kvstore.segments import BEGIN, END, SegmentTracker


def test_blank_lines_split_paragraphs():
    text = "First we add.\n2 + 3 = 5.\n\n  \nThen we double it.\n\n\nSo 10."
    assert split_paragraphs(text) == ["First we add.\n2 + 3 = 5.", "Then we double it.", "So 10."]


def test_step_per_line_solutions_are_grouped_to_the_target_length():
    lines = [f"Step {i}: we have {i} apples and {i} pears." for i in range(10)]  # 8 words a line
    paras = split_paragraphs("\n".join(lines), target_tokens=20)
    assert all(p.count("\n") == 2 for p in paras[:-1])  # 3 lines (24 words) reach 20 words
    assert "\n".join(paras).splitlines() == lines  # nothing lost or reordered
    # a short tail joins the group before it instead of making a paragraph of its own
    assert len(paras) == 3 and paras[-1].count("\n") == 3


def test_token_counter_decides_the_grouping():
    text = "a\nb\nc\nd"
    assert split_paragraphs(text, count_tokens=lambda s: 10 * len(s.split()), target_tokens=20) == ["a\nb", "c\nd"]
    assert split_paragraphs(text, target_tokens=100) == [text]


def test_gsm8k_cleaning():
    sol = "He makes 12 * 5 = <<12*5=60>>60 rolls.\nSo 60 - 40 = <<60-40=20>>20.\n#### 20"
    assert clean_solution(sol) == "He makes 12 * 5 = 60 rolls.\nSo 60 - 40 = 20.\nThe answer is \\boxed{20}."
    assert BEGIN not in clean_solution(f"x {BEGIN}y{END}")


@pytest.mark.parametrize("summary, why", [("", "empty"), ("   ", "empty"),
                                          ("We add two and three to get five.", "copy"),
                                          ("we ADD two and three   to get five.", "copy"),
                                          ("We add two and three to get five, which is the sum.", "longer"),
                                          ("2 + 3 = 5.", None)])
def test_summary_rejection(summary, why):
    assert check_summary(summary, "We add two and three to get five.") == why


def test_fallback_is_a_shorter_first_sentence():
    para = "We add two and three to get five. Then we double five to get ten, the answer."
    fb = fallback_summary(para)
    assert fb == "We add two and three to get five." and check_summary(fb, para) is None
    one = "We add two and three to get five and then double it."
    assert check_summary(fallback_summary(one), one) is None and one.startswith(fallback_summary(one))
    long = "word " * 60 + "end."
    assert len(fallback_summary(long, max_chars=40)) <= 40


def test_clean_summary_takes_the_first_line_without_label_or_delimiters():
    assert clean_summary(f"\n Summary: Sam has {END}42 eggs.\nMore text") == "Sam has 42 eggs."


def test_delimiters_are_inserted_after_each_paragraph_and_read_back_as_segments():
    paras, sums = ["Sam buys 42 eggs.", "He breaks 5, so 37 are left."], ["42 eggs bought.", "37 left."]
    text = insert_summaries(paras, sums)
    assert text == f"Sam buys 42 eggs.\n{BEGIN}42 eggs bought.{END}\n\nHe breaks 5, so 37 are left.\n{BEGIN}37 left.{END}"
    assert [p for p, d in split_augmented(text) if d] == [BEGIN, END, BEGIN, END]
    assert "".join(p for p, _ in split_augmented(text)) == text
    with pytest.raises(ValueError):
        insert_summaries(paras, sums[:1])


def test_the_policy_tracker_finds_one_segment_per_paragraph():
    """The augmented text, streamed character group by group as a model would write it, closes one
    ``model`` segment per paragraph in zoomr's own segment tracker."""
    text = insert_summaries(["Sam buys 42 eggs.", "He breaks 5.", "37 are left."], ["42.", "5 broken.", "37."])
    tracker = SegmentTracker("model")
    for k in range(0, len(text), 3):
        tracker.push(k // 3, text[k:k + 3])
    kinds = [s.kind for s in tracker.segments]
    assert kinds == ["model"] * 3


def test_augment_trace_replaces_rejected_summaries():
    sol = "Sam buys 6 * 7 = 42 eggs.\n\nHe has 42 - 5 = 37 eggs.\n#### 37"
    outs = ["", "He has 37 eggs left over after breaking five of them, which is a lot of eggs."]
    a = augment_trace(0, "q", sol, lambda ps: outs[:len(ps)])
    assert a.rejected == ["empty", "longer"]
    assert a.summaries == [fallback_summary(p) for p in a.paragraphs]
    assert all(check_summary(s, p) is None for s, p in zip(a.summaries, a.paragraphs))
    assert a.augmented.count(BEGIN) == 2 and a.augmented.endswith(END)


def test_field_detection():
    assert detect_fields({"question": "q", "answer": "a"}) == ("question", "answer")
    assert detect_fields({"problem": "p", "solution": "s", "answer": "5"}) == ("problem", "solution")
    with pytest.raises(UserError, match="question\\+answer or problem\\+solution"):
        detect_fields({"problem": "p", "answer": 5})


@pytest.mark.parametrize("content, msg", [(None, "no such file"), (b"", "no rows"), (b"\n\n", "no rows"),
                                          (b"not json\n", "line 1 is not JSON"), (b"[1, 2]\n", "not an object"),
                                          (b"\xff\xfe\n", "not UTF-8"),
                                          (b'{"question": "q"}\n', "no question\\+answer")])
def test_bad_trace_files(tmp_path, content, msg):
    p = tmp_path / "data.jsonl"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(UserError, match=msg):
        read_traces(p)


def test_limit_reads_only_the_first_rows(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps({"problem": f"p{i}", "solution": "s"}) + "\n" for i in range(5)) + "garbage\n")
    assert [q for q, _ in read_traces(p, limit=3)] == ["p0", "p1", "p2"]


def test_an_augmented_row_missing_a_field_names_the_field():
    from zoomr.finetune.augment import Augmented

    with pytest.raises(UserError, match=r"^aug.jsonl:1: not an augmented row \(no 'index' field\); write one"):
        Augmented.from_json({"problem": "q", "paragraphs": [], "summaries": [], "augmented": "x"}, "aug.jsonl:1")
