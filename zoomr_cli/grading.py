"""Final-answer extraction and strict checking: the last brace-matched ``\\boxed{}``, checked exactly.

Source: the Grading section of the algorithms reference (last ``\\boxed{}``, fallback "the answer is ...",
math-verify ``verify(gold, pred)`` with gold first) and math-verify's ``parse``/``verify``
(huggingface/Math-Verify, whose parser and structured comparisons this module builds on).

The grader must never mark a wrong answer right, so three rules are stricter than math-verify's defaults:

* **Cut-off answers are no answer.** A ``\\boxed{`` (or ``\\fbox{``) whose brace never closes means the text
  ended inside it (the length limit): :func:`extract_answer` returns None and does not fall back.
* **Exact values compare exactly.** math-verify rounds any pair with a decimal to 6 decimal places and
  compares constant expressions at 15 digits with small values chopped, so ``0.0000001`` and ``0.0000002``,
  or ``10^{-20}\\sqrt2`` and ``10^{-20}\\sqrt3``, are "equal". Here integers, fractions, radicals and powers
  compare symbolically (``simplify(a - b)`` is zero); a decimal is read as the exact terminating value it
  spells (``0.5`` is ``1/2``, ``3.0`` is ``3``, ``1e-7`` is ``10^{-7}``), so two decimals compare exactly;
  a decimal against an exact value must equal it when it could have spelt it (``1000001.0`` is not
  ``1000000``), and otherwise gets a *relative* tolerance (:data:`RELATIVE_TOLERANCE`: ``1.41421356`` is
  ``\\sqrt2``, ``1.41`` is not). The same rules hold inside tuples, sets and intervals, element by element.
* **The fallback is one expression.** "the answer is 240, which is the total" yields ``240``, not the clause.

:func:`grade` hides the parser and the checker behind one call so another grader can be swapped in.
Timeouts use math-verify's ``signal.alarm`` guard, so grading runs in the main thread only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache

RELATIVE_TOLERANCE = Fraction(1, 10**6)
"""Most relative error |d - x| / |x| for which a decimal ``d`` equals an exact value ``x`` it cannot spell.

Inclusive, and computed in exact arithmetic when ``x`` is rational, so the boundary is deterministic:
six significant digits of 1/3 (``0.333333``, error exactly 1e-6) and 1.41421356 for sqrt(2) pass;
``0.33333``, ``1.41`` and ``3.1416`` for pi (error 2.3e-6) do not."""

COMPARE_TIMEOUT_S = 5
"""Seconds one comparison of two parsed values may take before it counts as unequal (as math-verify)."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACES = re.compile(r"\\\\|\\[{}]|[{}]")  # an escaped backslash or brace is not a group delimiter
_ANCHOR = re.compile(r"answer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_SCIENTIFIC = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)")

# Tokens of a plain-text mathematical expression, tried in this order at each position.
_NUMBER = re.compile(r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][+-]?\d+)?|\.\d+")
_COMMAND = re.compile(r"\\[a-zA-Z]+|\\[%,;!]")
_VARIABLE = re.compile(r"[a-zA-Z](?![a-zA-Z])")  # one letter: x, n, i; a word ends the expression
_OPERATOR = re.compile(r"[-+*/^=<>()\[\]|!_%'°−×·]")
_TRAILING = "+-*/^=<>([|_,−×·"  # an expression cannot end on these; strip them
_UNICODE_MATH = str.maketrans({"−": "-", "×": "\\times ", "·": "\\cdot ", "°": "^\\circ"})


@dataclass(frozen=True)
class Extraction:
    """What a solution text answers.

    answer: the graded answer string (the last closed box, else the "the answer is" expression), or None.
    source: ``"boxed"``, ``"answer_is"``, ``"cut_off"`` (a box never closed: no answer) or ``"none"``.
    boxed: contents of every closed ``\\boxed{}``/``\\fbox{}``, in order of their opening brace.
    """

    answer: str | None
    source: str
    boxed: tuple[str, ...]

    @cached_property
    def n_boxed_distinct(self) -> int:
        """How many mathematically distinct values ``boxed`` holds (:func:`distinct_values`); 0 without boxes.

        Lets answers that box several different values be audited. Computed on first use: it parses every
        box with math-verify, which extracting the answer alone does not need.
        """
        return len(distinct_values(self.boxed))

    @property
    def cut_off(self) -> bool:
        """True when the text ended inside a box (cut by the length limit): the answer is None."""
        return self.source == "cut_off"


def _boxes(text: str) -> list[str | None]:
    """Content of each ``\\boxed{`` / ``\\fbox{``, in order of opening; None where the brace never closes."""
    closing: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACES.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            closing[stack.pop()] = m.start()
    out: list[str | None] = []
    for m in _BOX_OPEN.finditer(text):
        brace = m.end() - 1
        end = closing.get(brace)
        out.append(None if end is None else text[brace + 1:end].strip())
    return out


def boxed_values(text: str) -> list[str]:
    """Contents of every closed ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces matched), in order.

    A box nested in another is listed after it (``\\boxed{\\boxed{5}}`` gives ``["\\boxed{5}", "5"]``).
    """
    return [b for b in _boxes(text) if b is not None]


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched.

    None when there is no box, or when a box never closes: its brace runs to the end of the text, so the
    text was cut inside it and any earlier box is no longer the final answer.
    """
    boxes = _boxes(text)
    if not boxes or None in boxes:
        return None
    return boxes[-1]


def _group_end(s: str, i: int) -> int | None:
    """Index just past the ``}`` matching the ``{`` at ``s[i]``; None if it never closes."""
    depth = 0
    j = i
    while j < len(s):
        if s[j] == "\\":
            j += 2  # escaped character, e.g. \{ inside a group
            continue
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _token(s: str, i: int) -> tuple[str | None, int]:
    """Kind and end of the expression token at ``s[i]``: num, cmd, var, op, close, group, or cut (a brace
    group that never closes); (None, i) if no token starts there."""
    if s[i] == "{":
        end = _group_end(s, i)
        return ("group", end) if end is not None else ("cut", i)
    for kind, pattern in (("num", _NUMBER), ("cmd", _COMMAND), ("var", _VARIABLE), ("op", _OPERATOR)):
        m = pattern.match(s, i)
        if m:
            return ("close" if m.group() in ")]" else kind), m.end()
    return None, i


def _plain_expression(s: str, i: int) -> tuple[str, int] | None:
    """The one mathematical expression starting at ``s[i]`` in running text, and the index where it ends.

    Numbers (``2,000``, ``3.5``, ``1e-7``), LaTeX commands with their brace groups (``\\frac{3}{4}``),
    single-letter variables and operators; a space continues it only next to an operator or after a
    command, a comma only before another operand (``5, 6``; not ``240, which``). A word ends it.
    None when there is none, or when a brace group in it never closes.
    """
    start, prev = i, ""
    while i < len(s):
        j = i
        while j < len(s) and s[j] in " \t":
            j += 1
        if j > i:
            if j < len(s) and s[j] != "$" and (prev in ("op", "cmd") or _OPERATOR.match(s, j)):
                i = j
                continue
            break
        if s[i] == ",":
            while j + 1 < len(s) and s[j + 1] in " \t":
                j += 1
            nxt, _ = _token(s, j + 1) if j + 1 < len(s) else (None, 0)
            if prev in ("num", "var", "group", "cmd", "close") and nxt in ("num", "cmd", "var", "group"):
                i, prev = j + 1, "op"
                continue
            break
        kind, end = _token(s, i)
        if kind == "cut":
            return None  # "\\frac{1}{2" ends inside a group: the expression was cut, not "\\frac{1}"
        if kind is None:
            break
        i, prev = end, kind
    expr = s[start:i].rstrip()
    while expr:
        last = expr[-1]
        unmatched = last in ")]" and expr.count(last) > expr.count("(" if last == ")" else "[")
        if last not in _TRAILING and not unmatched:
            break
        expr = expr[:-1].rstrip()
    if not expr:
        return None
    return expr.translate(_UNICODE_MATH), start + len(expr)


def _expression_after(text: str, i: int) -> tuple[str, bool] | None:
    """The one expression right after an "answer is" anchor ending at ``text[i]``, and whether it is whole.

    ``$...$``, ``$$...$$``, ``\\(...\\)`` and ``\\[...\\]`` give their content, whole once closed; ``$`` or
    ``\\$`` before a digit is a currency sign; otherwise :func:`_plain_expression`, whole when text other than
    dangling operators follows it (one at the very end, or ending on ``+``, may have been cut). Markdown
    emphasis (``**72**``) is skipped.
    """
    while i < len(text) and text[i] in " \t*_":
        i += 1
    for opener, closer in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if not text.startswith(opener, i):
            continue
        body = i + len(opener)
        end = text.find(closer, body)
        if end >= 0 and not (opener == "$" and text[body:body + 1].isdigit()):
            inner = text[body:end].strip()
            return (inner, True) if inner else None
        i = body  # unclosed, or "$18": money, read as plain text
        break
    if text.startswith("\\$", i):
        i += 2
    found = _plain_expression(text, i)
    if found is None:
        return None
    # whole once real text follows; an operator it ended on at the very end ("3+") means it was cut
    rest = text[found[1]:]
    return found[0], any(not (c.isspace() or c in _TRAILING) for c in rest)


def _answer_is(text: str, truncated: bool) -> str | None:
    """The expression after the last "answer is" / "answer:" that is followed by one (None if none).

    With ``truncated`` (the generation stopped at the length limit) only the last anchor counts, and an
    expression that is not whole is rejected: a number at the very end may be cut (``24`` of ``245``).
    """
    for m in reversed(list(_ANCHOR.finditer(text))):
        found = _expression_after(text, m.end())
        if truncated:
            return found[0] if found is not None and found[1] else None
        if found is not None:
            return found[0]
    return None


def extract(text: str, *, truncated: bool = False) -> Extraction:
    """The final answer of a solution ``text``, where it came from, and its boxed values.

    Rules, in order: a box that never closes → no answer (``source="cut_off"``); else the last closed
    ``\\boxed{}``/``\\fbox{}`` that holds more than white space (an empty box, a prompt's template echoed,
    states nothing); else the one expression after the last "the answer is" / "answer:" (:func:`_answer_is`;
    ``truncated=True`` when the generation hit the length limit makes it stricter); else None. Never raises
    on any string.
    """
    boxes = _boxes(text)
    closed = tuple(b for b in boxes if b is not None)
    if None in boxes:
        return Extraction(None, "cut_off", closed)
    filled = [b for b in closed if b.strip()]  # an empty \boxed{} states no answer (a template echoed)
    if filled:
        return Extraction(filled[-1], "boxed", closed)
    fallback = _answer_is(text, truncated)
    return Extraction(fallback, "answer_is" if fallback is not None else "none", closed)


def extract_answer(text: str, *, truncated: bool = False) -> str | None:
    """The final answer of a solution: ``extract(text, truncated=truncated).answer`` (see :func:`extract`)."""
    return extract(text, truncated=truncated).answer


def n_boxed_distinct(text: str) -> int:
    """How many mathematically distinct values the closed boxes of ``text`` hold (0 without boxes)."""
    return extract(text).n_boxed_distinct


def distinct_values(values: list[str] | tuple[str, ...]) -> list[str]:
    """The first of each class of mathematically equal answer strings in ``values``, in order.

    Two strings are one class when they are equal up to whitespace or :func:`grade` (earlier one as gold)
    calls them equal; an empty string is its own class.
    """
    reps: list[str] = []
    seen: set[str] = set()
    for v in values:
        key = "".join(v.split())
        if key in seen:
            continue
        seen.add(key)
        if key and any(grade(r, v) for r in reps if "".join(r.split())):
            continue
        reps.append(v)
    return reps


@lru_cache(maxsize=512)
def _parse(s: str) -> tuple:
    """math-verify parses of an answer string: sympy values and normalised strings, best first.

    The string is read as LaTeX (wrapped in ``$...$`` unless it already has math delimiters or a box),
    else as a plain expression. A bare ``1e-7`` becomes ``1\\times 10^{-7}`` first: math-verify reads
    the ``e`` of scientific notation as Euler's number in LaTeX and drops the exponent in plain text.
    """
    from math_verify import parse

    s = s.strip()
    sci = _SCIENTIFIC.fullmatch(s)
    if sci:
        s = f"{sci.group(1)}\\times 10^{{{sci.group(2)}}}"
    wrapped = s if s.startswith("$") or "\\boxed" in s else f"${s}$"
    return tuple(parse(wrapped) or parse(s))


def _exact(e):
    """``e`` with every sympy Float replaced by the exact rational its decimal digits spell (0.1 → 1/10)."""
    import sympy

    floats = e.atoms(sympy.Float)
    if not floats:
        return e
    try:
        return e.xreplace({f: sympy.Rational(str(f)) for f in floats})
    except (ValueError, TypeError):  # inf/nan floats have no rational
        return e


def _decimal_places(q) -> int | None:
    """Decimal places of the terminating expansion of rational ``q`` (1/8 → 3); None if it never ends."""
    den, twos, fives = int(q.q), 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    return max(twos, fives) if den == 1 else None


def _exactly_equal(x, y) -> bool:
    """Symbolic equality of two constant sympy values (no tolerance of any size)."""
    import sympy

    if x == y:
        return True
    if x.is_Rational and y.is_Rational:
        return False
    if not (x.is_finite and y.is_finite):
        return False
    diff = sympy.simplify(x - y)
    if diff.is_zero is not None:
        return bool(diff.is_zero)
    return x.equals(y) is True


def _relatively_close(d, x) -> bool:
    """|d - x| <= RELATIVE_TOLERANCE * |x|, exactly for rationals, else at 50 significant digits."""
    import sympy

    rtol = sympy.Rational(RELATIVE_TOLERANCE.numerator, RELATIVE_TOLERANCE.denominator)
    if d.is_Rational and x.is_Rational:
        return bool(abs(d - x) <= rtol * abs(x))
    diff = sympy.Abs(d - x).evalf(50)
    bound = (rtol * sympy.Abs(x)).evalf(50)
    if not (diff.is_Number and bound.is_Number and diff.is_finite and bound.is_finite):
        return False
    return bool(diff <= bound)


def _scalars_equal(gold, pred) -> bool:
    """Equality of two constant scalars by the module rules (exact values exactly, decimals see above)."""
    import sympy

    gold_decimal, pred_decimal = bool(gold.atoms(sympy.Float)), bool(pred.atoms(sympy.Float))
    g, p = _exact(gold), _exact(pred)
    if _exactly_equal(g, p):
        return True
    if gold_decimal == pred_decimal:  # exact vs exact, or decimal vs decimal: already compared exactly
        return False
    d, x = (g, p) if gold_decimal else (p, g)
    if not (d.is_finite and x.is_finite):
        return False
    if d.is_Rational and x.is_Rational:
        places_x, places_d = _decimal_places(x), _decimal_places(d)
        if places_x is not None and places_d is not None and places_x <= places_d:
            return False  # the decimal could have spelt x exactly and does not: 1000001.0 is not 1000000
    return _relatively_close(d, x)


def _percent_readings(e) -> list:
    """``X%`` read both ways, as ``X`` and ``X/100`` (math-verify: 9% equals 9 and 0.09); others as is."""
    import sympy

    if (isinstance(e, sympy.Mul) and len(e.args) == 2
            and e.args[1] == sympy.UnevaluatedExpr(sympy.Rational(1, 100))):
        return [e.args[0], e.args[0] / 100]
    return [e]


def _is_scalar(e) -> bool:
    import sympy

    return isinstance(e, sympy.Expr) and bool(e.is_number)


def _structures_equal(gold, pred) -> bool | None:
    """Element-wise equality of two intervals, two tuples or two finite sets; None for any other pair.

    Elements compare by :func:`_values_equal`, so the scalar rules hold inside structures too (math-verify
    would round decimals there). Set elements are matched greedily, each pred element used once.
    """
    import sympy

    if isinstance(gold, sympy.Interval) and isinstance(pred, sympy.Interval):
        return (gold.left_open == pred.left_open and gold.right_open == pred.right_open
                and _values_equal(gold.start, pred.start) and _values_equal(gold.end, pred.end))
    if isinstance(gold, sympy.Tuple) and isinstance(pred, sympy.Tuple):
        return len(gold) == len(pred) and all(_values_equal(g, p) for g, p in zip(gold, pred))
    if isinstance(gold, sympy.FiniteSet) and isinstance(pred, sympy.FiniteSet):
        left = list(pred.args)
        if len(left) != len(gold.args):
            return False
        for g in gold.args:
            hit = next((k for k, p in enumerate(left) if _values_equal(g, p)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    return None


def _values_equal(gold, pred) -> bool:
    """Equality of two math-verify sympy values, gold first.

    Constant scalars (numbers, radicals, powers, pi, percentages) follow the module rules; two intervals,
    tuples or finite sets compare element by element (:func:`_structures_equal`). Everything else
    (equations, expressions with variables, matrices, a set against a tuple) goes to math-verify's
    ``verify`` with decimals made exact first, so its rounding of decimals never applies, and its numeric
    check at 100 digits instead of 15, so its chopping of small values does not hide a difference.
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException
    from math_verify.grader import is_assignment_relation, is_equation, take_last_relation
    from math_verify.utils import timeout

    # Mirror verify's reading of equations: "x = 5" answers "5"; an equation answers an assignment gold.
    if is_equation(pred) and not is_equation(gold):
        pred = take_last_relation(pred).rhs
    elif is_assignment_relation(gold) and not is_equation(pred):
        gold = take_last_relation(gold).rhs

    structured = _structures_equal(gold, pred)
    if structured is not None:
        return structured
    for g in _percent_readings(gold):
        for p in _percent_readings(pred):
            if _is_scalar(g) and _is_scalar(p):
                try:
                    if timeout(COMPARE_TIMEOUT_S)(_scalars_equal)(g.doit(), p.doit()):
                        return True
                except TimeoutException:
                    continue
                except (ArithmeticError, TypeError, ValueError, AttributeError, RecursionError) as err:
                    if "main thread" in str(err):
                        raise
                    continue
            elif verify(_exact(g), _exact(p), numeric_precision=100, timeout_seconds=COMPARE_TIMEOUT_S):
                return True
    return False


def grade(gold: str, prediction: str | None) -> bool:
    """True when answer string ``prediction`` is mathematically equal to ``gold`` under the module rules.

    Both are parsed by math-verify (LaTeX first, then plain text), which drops units and formatting:
    ``\\text{ cm}``, ``\\$``, ``2,000``, ``90^\\circ``, ``\\dfrac``. A None or blank prediction is wrong; if
    either side does not parse, the stripped strings must be identical. Not symmetric (gold first, as
    math-verify): an assignment gold ``x = 5`` is answered by ``5``. Raises ValueError outside the main
    thread (signal-based timeouts).
    """
    if prediction is None or not str(prediction).strip():
        return False
    g, p = _parse(str(gold)), _parse(str(prediction))
    if not g or not p:
        return str(gold).strip() == str(prediction).strip()
    for a in g:
        for b in p:
            if isinstance(a, str) or isinstance(b, str):
                if isinstance(a, str) and isinstance(b, str) and a.strip() and a.strip() == b.strip():
                    return True
            elif _values_equal(a, b):
                return True
    return False
