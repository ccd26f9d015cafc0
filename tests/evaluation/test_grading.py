import pytest

from zoomr.grading import extract_answer, grade, last_boxed


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


# --- strict grading (issue 10 part 6): every rule has equal and non-equal pairs ----------------------------

from fractions import Fraction  # noqa: E402

from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from zoomr.grading import boxed_values, distinct_values, extract, n_boxed_distinct  # noqa: E402

FAST = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize("text", [r"so \boxed{\frac{1}{2", r"First \boxed{3}. Then \boxed{4",
                                  r"The answer is 7. Finally \boxed{", r"\boxed{3} and \fbox{\sqrt{2"])
def test_box_cut_by_the_length_limit_is_no_answer(text):
    e = extract(text)
    assert e.answer is None and e.cut_off and extract_answer(text) is None and last_boxed(text) is None


@pytest.mark.parametrize("text,answer", [(r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
                                         (r"First \boxed{3}. Then \boxed{4}.", "4"),
                                         (r"The answer is 7. Finally \boxed{8}", "8"),
                                         (r"\boxed{3} and \fbox{\sqrt{2}}", r"\sqrt{2}")])
def test_closed_box_is_the_answer(text, answer):
    e = extract(text)
    assert e.answer == answer and e.source == "boxed" and not e.cut_off


@pytest.mark.parametrize("text,answer", [(r"\boxed{\{1,2\}}", r"\{1,2\}"),
                                         (r"\boxed{\left\{ x \right.}", r"\left\{ x \right.")])
def test_escaped_braces_do_not_open_or_close_a_box(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text,answer", [
    ("the answer is 240, which is the total", "240"),
    (r"So the answer is $\frac{3}{4}$.", r"\frac{3}{4}"),
    ("The answer is: 18 dollars", "18"),
    ("The answer is **72**.", "72"),
    (r"the answer is \frac{1}{2}, since", r"\frac{1}{2}"),
    ("so the answer is (3, 4).", "(3, 4)"),
    ("the answer is 2,000 apples", "2,000"),
    ("the answer is $18.", "18"),
    (r"The answer is \(\sqrt{3}\) exactly", r"\sqrt{3}"),
    ("Final answer: x = 5", "x = 5"),
    ("The answer is 42. Check: the answer is correct.", "42"),
    ("(the answer is 5).", "5"),
])
def test_fallback_is_one_expression(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text", ["the answer is correct", r"the answer is $\frac{1}{2", "no anchor 42 here"])
def test_fallback_without_an_expression_is_none(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize("text,right,wrong", [("The answer is: 18 dollars", "18", "19"),
                                              ("the answer is 240, which is the total", "240", "2"),
                                              (r"the answer is $\frac{3}{4}$.", "0.75", "3")])
def test_fallback_expression_grades_as_the_number(text, right, wrong):
    answer = extract_answer(text)
    assert grade(right, answer) and not grade(wrong, answer)


@pytest.mark.parametrize("text,whole", [("The answer is 24", False), ("The answer is 24.", True),
                                        ("The answer is 24, so", True),
                                        (r"the answer is $\frac{1}{2}$", True),
                                        ("The answer is 12. Wait, so the answer is", False),
                                        # cut on an operator: "3+" was going on to "3+4", not an answer of 3
                                        ("The answer is 3+", False), ("The answer is 3 +\n", False),
                                        ("The answer is 3 + 4 = 7.", True)])
def test_truncated_generation_rejects_an_expression_at_the_end(text, whole):
    assert (extract_answer(text, truncated=True) is not None) == whole


def test_untruncated_text_keeps_the_expression_at_the_end():
    assert extract_answer("The answer is 24") == "24"


@pytest.mark.parametrize("text,values,n", [
    ("no box here", [], 0),
    (r"\boxed{5}", ["5"], 1),
    (r"\boxed{1/2} and \boxed{\frac{1}{2}} or \boxed{ 0.5 }", ["1/2", r"\frac{1}{2}", "0.5"], 1),
    (r"\boxed{1/2} then \boxed{0.25} then \boxed{1/2}", ["1/2", "0.25", "1/2"], 2),
    (r"\boxed{\boxed{5}}", [r"\boxed{5}", "5"], 1),
    (r"\boxed{1e-7} or \boxed{2e-7}", ["1e-7", "2e-7"], 2),
])
def test_boxed_values_and_distinct_count(text, values, n):
    assert boxed_values(text) == values
    assert n_boxed_distinct(text) == n == extract(text).n_boxed_distinct
    assert len(distinct_values(values)) == n


EQUAL = {
    "integers exactly": [("1000000", "1000000"), ("-3", "-3"), ("2,000", "2000")],
    "powers and fractions exactly": [(r"\frac{1}{2^{10}}", r"\frac{1}{1024}"), (r"2^{10}", "1024"),
                                     (r"\frac{6}{8}", r"\frac{3}{4}")],
    "radicals exactly": [(r"\sqrt{8}", r"2\sqrt{2}"), (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}")],
    "small values exactly": [("1e-7", r"1\times 10^{-7}"), (r"10^{-30}", r"\frac{1}{10^{30}}"),
                             ("0.0000001", "1e-7")],
    "decimal spelling the exact value": [("0.5", r"\frac12"), ("3", "3.0"), (r"\frac{3}{4}", "0.75"),
                                         (r"\frac{3\sqrt{2}}{2}", r"1.5\sqrt{2}"), ("2500", "2.5e3")],
    "decimal within relative 1e-6 of a value it cannot spell": [
        (r"\sqrt{2}", "1.41421356"), (r"\frac{1}{3}", "0.333333"), (r"\pi", "3.14159"),
        (r"\frac{1}{1024}", "0.000976563"), (r"\frac{2}{3}", "0.666667"),
        (r"\frac{2}{3}", "0.666666")],  # six digits truncated: error exactly 1e-6, the inclusive bound
    "decimal against decimal exactly": [("1.5", "1.50"), ("0.25", "0.250")],
    "structures element-wise": [(r"(\frac13, 1)", "(0.333333, 1)"), (r"\{1, 2\}", r"\{2, 1\}"),
                                ("[0, 1)", "[0,1)")],
    "percentages": [("25", r"25\%"), (r"\frac14", r"25\%")],
    "variables symbolically": [("x+1", "1+x"), (r"\frac{x}{2}", "0.5x")],
    "assignments": [("x=5", "5"), ("5", "x = 5")],
}
UNEQUAL = {
    "integers exactly": [("1000000", "1000001"), ("-3", "3"), ("2,000", "2001")],
    "powers and fractions exactly": [(r"\frac{1}{2^{10}}", r"\frac{1}{2^{11}}"), (r"2^{10}", "1025"),
                                     (r"\frac{6}{8}", r"\frac{3}{5}")],
    "radicals exactly": [(r"10^{-20}\sqrt{2}", r"10^{-20}\sqrt{3}"), (r"\sqrt{10^{100}+1}", r"10^{50}")],
    "small values exactly": [("1e-7", "2e-7"), (r"10^{-30}", r"2\times 10^{-30}"), ("0", "0.0000001"),
                             ("0.0000001", "0.0000002")],
    "decimal spelling the exact value": [("1000000", "1000001.0"), (r"\frac12", "0.5000001"),
                                         ("3", "3.000001")],
    "decimal within relative 1e-6 of a value it cannot spell": [
        (r"\sqrt{2}", "1.41"), (r"\frac{1}{3}", "0.33333"), (r"\pi", "3.1416"),
        (r"\frac{1}{1024}", "0.0009765"),
        (r"\frac{2}{3}", "0.66666")],
    "decimal against decimal exactly": [("3.14", "3.14159"), ("0.25", "0.2500001")],
    "structures element-wise": [(r"(\frac13, 1)", "(0.33333, 1)"), ("(1e-7, 1)", "(2e-7, 1)"),
                                ("[0, 1)", "[0,1]"), (r"\{1, 2\}", r"\{1, 3\}")],
    "percentages": [("26", r"25\%"), (r"\frac13", r"25\%")],
    "variables symbolically": [("x+1", "x+2"), (r"\frac{x}{2^{10}}", r"\frac{x}{2^{11}}")],
    "assignments": [("x=5", "6"), ("5", "x = 6")],
}


def _cases(table):
    return [pytest.param(g, p, id=f"{rule}: {g} vs {p}") for rule, pairs in table.items() for g, p in pairs]


def test_every_rule_has_equal_and_unequal_pairs():
    assert EQUAL.keys() == UNEQUAL.keys()


@pytest.mark.parametrize("gold,pred", _cases(EQUAL))
def test_rule_equal_pairs(gold, pred):
    assert grade(gold, pred)


@pytest.mark.parametrize("gold,pred", _cases(UNEQUAL))
def test_rule_unequal_pairs(gold, pred):
    assert not grade(gold, pred)


def _frac(f: Fraction) -> str:
    return rf"\frac{{{f.numerator}}}{{{f.denominator}}}" if f.denominator != 1 else str(f.numerator)


fractions = st.fractions(min_value=-10**9, max_value=10**9, max_denominator=10**6)


@FAST
@given(fractions, fractions)
def test_distinct_fractions_never_grade_equal(a, b):
    assume(a != b)
    assert not grade(_frac(a), _frac(b))


@FAST
@given(fractions)
def test_a_fraction_equals_itself_unreduced(a):
    assert grade(_frac(a), rf"\frac{{{3 * a.numerator}}}{{{3 * a.denominator}}}")


@FAST
@given(st.integers(-10**12, 10**12), st.integers(1, 10**6))
def test_distinct_integers_never_grade_equal(n, d):
    assert not grade(str(n), str(n + d)) and not grade(str(n), f"{n + d}.0")


@FAST
@given(st.integers(-10**12, 10**12))
def test_an_integer_equals_its_decimal_and_boxed_forms(n):
    assert grade(str(n), f"{n}.0")
    assert grade(str(n), extract_answer(rf"so the total is $\boxed{{{n}}}$."))


@FAST
@given(st.integers(1, 9), st.integers(1, 9), st.integers(7, 60))
def test_tiny_values_compare_exactly(a, b, exponent):
    assume(a != b)
    assert not grade(f"{a}e-{exponent}", f"{b}e-{exponent}")
    assert grade(f"{a}e-{exponent}", rf"{a}\times 10^{{-{exponent}}}")


answers = st.sampled_from(["5", r"\frac{1}{2}", r"\sqrt{3}", "x = 2", r"\{1, 2\}",
                          r"\frac{\sqrt{3}}{2^{10}}"])
prefixes = st.sampled_from(["", "The answer is 7. ", r"First \boxed{3}. ", "Therefore "])


@FAST
@given(prefixes, answers, st.data())
def test_text_cut_inside_a_box_extracts_none(prefix, answer, data):
    text = f"{prefix}so $\\boxed{{{answer}}}$ done"
    opening = text.rindex("\\boxed{") + len("\\boxed{")
    cut = data.draw(st.integers(opening, opening + len(answer)), label="cut")  # after "{", before its "}"
    assert extract_answer(text[:cut]) is None
    assert extract_answer(text) == answer


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="\\boxed{}$ answeris:0123456789.,-x", max_size=60))
def test_extract_never_raises_and_counts_consistently(text):
    e = extract(text)
    assert e.answer is None or isinstance(e.answer, str)
    assert 0 <= e.n_boxed_distinct <= len(e.boxed)
    assert (e.answer is None) or e.source in ("boxed", "answer_is")


@pytest.mark.parametrize("text,answer,source", [(r"17*23 = 381. The answer is within \boxed{}.", None, "none"),
                                                (r"\boxed{ }", None, "none"),
                                                (r"\boxed{4} then \boxed{}", "4", "boxed"),
                                                (r"The answer is 7. \boxed{}", "7", "answer_is")])
def test_an_empty_box_states_no_answer(text, answer, source):
    """A model that echoes the prompt's "\\boxed{}" has answered nothing: an earlier filled box or "the answer
    is" counts, else there is no answer (not the empty string)."""
    e = extract(text)
    assert (e.answer, e.source) == (answer, source)
    assert extract_answer(text) == answer

