"""Final-answer extraction and checking: the last brace-matched ``\\boxed{}``, compared with math-verify.

One function, :func:`grade`, hides the extractor and the checker so another grader can be swapped in.
"""

from __future__ import annotations

import re

_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+?)\$?\s*(?:\.|$)", re.IGNORECASE | re.MULTILINE)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched; None if absent."""
    for macro in ("\\boxed", "\\fbox"):
        start = text.rfind(macro)
        if start < 0:
            continue
        i = start + len(macro)
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j].strip()
        return None  # unbalanced: the answer was cut off
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last \\boxed{}, else the last "the answer is ...", else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = _ANSWER_IS.findall(text)
    return found[-1].strip() if found else None


def grade(gold: str, prediction: str | None) -> bool:
    """True when ``prediction`` is mathematically equivalent to ``gold`` (math-verify, gold first).

    Both are parsed as LaTeX (wrapped in ``$...$``) and as plain expressions; a None prediction is wrong.
    """
    if prediction is None or not str(prediction).strip():
        return False
    from math_verify import parse, verify

    def parsed(s: str):
        s = s.strip()
        return parse(s if s.startswith("$") or "\\boxed" in s else f"${s}$") or parse(s)

    g, p = parsed(str(gold)), parsed(str(prediction))
    if not g or not p:
        return str(gold).strip() == str(prediction).strip()
    return bool(verify(g, p))
