import pytest

from zoomr_cli.grading import extract_answer, grade, last_boxed


def test_last_boxed_matches_nested_braces():
    text = r"First \boxed{1}. Then $\boxed{\frac{1}{2}}$ and done."
    assert last_boxed(text) == r"\frac{1}{2}"


def test_unbalanced_boxed_is_none():
    assert last_boxed(r"so \boxed{\frac{1}{2") is None


def test_answer_is_fallback():
    assert extract_answer("We add them. The answer is 72.") == "72"


@pytest.mark.parametrize("gold,pred", [("72", "72"), ("0.5", r"\frac{1}{2}"), (r"\frac{3}{4}", "0.75"),
                                       ("72", "72.0"), (r"\sqrt{2}", r"\sqrt 2")])
def test_equivalent_pairs(gold, pred):
    assert grade(gold, pred)


@pytest.mark.parametrize("gold,pred", [("72", "27"), ("0.5", r"\frac{1}{3}"), ("72", None), ("72", "")])
def test_non_equivalent_pairs(gold, pred):
    assert not grade(gold, pred)


@pytest.mark.parametrize("gold,pred", [("18", r"18 \text{ dollars}"), ("18", r"\$18"), ("5", r"5\text{ cm}"),
                                       ("90", r"90^\circ"), ("2,000", "2000"), (r"\frac{1}{2}", r"\dfrac{1}{2}")])
def test_units_and_formatting_are_ignored(gold, pred):
    assert grade(gold, pred)


@pytest.mark.parametrize("gold,pred", [("5", r"6\text{ cm}"), ("18", r"\$81"), (r"\frac{1}{2}", r"\frac{2}{1}")])
def test_units_do_not_hide_a_wrong_number(gold, pred):
    assert not grade(gold, pred)


def test_boxed_with_nested_braces_is_graded_whole():
    answer = extract_answer(r"Thus $x = \boxed{\frac{\sqrt{3}}{2}}$.")
    assert answer == r"\frac{\sqrt{3}}{2}"
    assert grade(r"\frac{\sqrt3}{2}", answer) and not grade(r"\frac{\sqrt2}{2}", answer)
