"""Summary data augmentation (ZoomR §3.2, App. A.1): reasoning traces → paragraphs, each followed by its
delimited summary. Pure functions over text; the summarizer is a callable the caller supplies.

A trace is one JSONL row: GSM8K's ``question`` + ``answer`` or MATH's ``problem`` + ``solution``
(:func:`detect_fields`). The solution is split into paragraphs (:func:`split_paragraphs`), each paragraph is
summarized from the paragraph alone (the paper: "each summary is generated based only on the prompt
instruction and its corresponding paragraph"), a summary that is empty, no shorter than its paragraph or a
copy of it is replaced by an extractive one (:func:`check_summary`, :func:`fallback_summary`), and the
summaries are inserted between the delimiters the ``zoomr`` policy's ``--summaries model`` mode reads
(:data:`zoomr.kvstore.segments.BEGIN` / ``END``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from zoomr.errors import UserError
from zoomr.kvstore.segments import BEGIN, END

# (problem field, solution field) of the trace formats read, in the order they are tried
TRACE_FIELDS = (("question", "answer"), ("problem", "solution"))
# App. A.1's prompt is not reproduced in the paper's text; this one asks for the same thing: one short
# sentence about this paragraph alone
SUMMARY_PROMPT = ("Summarize the following step of a math solution in one short sentence. Keep the numbers it "
                  "computes. Write only the summary.")
# GSM8K's steps are 10-25 tokens a line: about two lines per summarized paragraph
DEFAULT_PARAGRAPH_TOKENS = 32

_CALCULATOR = re.compile(r"<<[^<>]*>>")            # GSM8K's calculator annotations: <<48/2=24>>
_GSM8K_ANSWER = re.compile(r"\n?####\s*(.+?)\s*$")  # GSM8K's final line: #### 72
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n")


def detect_fields(row: dict, where: str = "DATA") -> tuple[str, str]:
    """The (problem, solution) field names of a trace row: ``question``/``answer`` (GSM8K) or
    ``problem``/``solution`` (MATH), whichever it has with string values.

    Raises:
        UserError: the row has neither pair.
    """
    for prob, sol in TRACE_FIELDS:
        if isinstance(row.get(prob), str) and isinstance(row.get(sol), str):
            return prob, sol
    names = " or ".join(f"{p}+{s}" for p, s in TRACE_FIELDS)
    raise UserError(f"{where}: a row has no {names} text fields (fields: {', '.join(sorted(row)) or 'none'})")


def clean_solution(text: str) -> str:
    """A solution as training text: GSM8K's calculator annotations dropped, its ``#### N`` line written as
    ``The answer is \\boxed{N}.`` (the answer form ``zoomr solve`` asks for and grades); other text unchanged.
    Delimiter strings already in the text are removed, so they mark only the summaries inserted here."""
    text = _CALCULATOR.sub("", text).replace(BEGIN, "").replace(END, "").strip()
    m = _GSM8K_ANSWER.search(text)
    if m:
        text = text[:m.start()].rstrip() + f"\nThe answer is \\boxed{{{m.group(1)}}}."
    return text


def split_paragraphs(text: str, count_tokens: Callable[[str], int] | None = None,
                     target_tokens: int = DEFAULT_PARAGRAPH_TOKENS) -> list[str]:
    """Paragraphs of a solution (the paper segments a trace "into paragraphs").

    Blank lines separate paragraphs. A text without blank lines but with several lines (GSM8K writes one
    step per line) has its consecutive lines grouped until a group reaches ``target_tokens``, so that each
    summarized segment is long enough for a summary to compress it.

    Args:
        count_tokens: length of a text in tokens (the model's tokenizer); default: whitespace words.
        target_tokens: least tokens of a grouped paragraph (the last group may be shorter).
    Returns:
        the non-empty paragraphs, stripped, in order (none for a blank text).
    """
    count = count_tokens or (lambda s: len(s.split()))
    blocks = [b.strip() for b in _BLANK_LINE.split(text) if b.strip()]
    if len(blocks) != 1:
        return blocks
    lines = [ln.strip() for ln in blocks[0].splitlines() if ln.strip()]
    out: list[str] = []
    group: list[str] = []
    for line in lines:
        group.append(line)
        if count("\n".join(group)) >= target_tokens:
            out.append("\n".join(group))
            group = []
    if group:
        if out and count("\n".join(group)) < target_tokens // 2:
            out[-1] = out[-1] + "\n" + "\n".join(group)  # a short tail joins the group before it
        else:
            out.append("\n".join(group))
    return out


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def clean_summary(raw: str) -> str:
    """A summarizer's output as a summary: its first non-empty line, a leading ``Summary:`` label and
    delimiter strings removed, whitespace collapsed."""
    text = raw.replace(BEGIN, " ").replace(END, " ")
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"^\s*(\*\*)?summary(\*\*)?\s*[:\-]\s*", "", line, flags=re.IGNORECASE)
    return " ".join(line.split())


def check_summary(summary: str, paragraph: str) -> str | None:
    """Why ``summary`` cannot stand for ``paragraph``, or None when it can.

    Returns:
        ``"empty"``; ``"longer"`` (no shorter than the paragraph, characters: it would compress nothing);
        ``"copy"`` (the paragraph itself, up to case and whitespace); None for an accepted summary.
    """
    if not summary.strip():
        return "empty"
    if _norm(summary) == _norm(paragraph):
        return "copy"
    if len(summary) >= len(paragraph):
        return "longer"
    return None


def fallback_summary(paragraph: str, max_chars: int = 100) -> str:
    """Extractive stand-in for a rejected summary: the paragraph's first sentence, cut at a word boundary
    to ``max_chars`` and, when that sentence is the whole paragraph, to half of it, so it is always
    shorter than the paragraph (the same idea as the ``auto`` mode's extractive segments,
    :func:`zoomr.kvstore.segments.stand_in`)."""
    flat = " ".join(paragraph.split())
    first = _SENTENCE_END.split(paragraph.strip(), maxsplit=1)[0]
    first = " ".join(first.split())
    limit = max_chars if len(first) < len(flat) else min(max_chars, max(1, len(flat) // 2))
    if len(first) <= limit:
        return first
    cut = first[:limit]
    return cut.rsplit(" ", 1)[0] if " " in cut else cut


def insert_summaries(paragraphs: list[str], summaries: list[str]) -> str:
    """The augmented solution: each paragraph, then ``\\n<|begin_of_summary|>summary<|end_of_summary|>``,
    paragraphs separated by a blank line (so R_i is the paragraph and S_i its summary, as
    :class:`zoomr.kvstore.segments.SegmentTracker` reads them in ``--summaries model``).

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(paragraphs) != len(summaries):
        raise ValueError(f"{len(paragraphs)} paragraphs but {len(summaries)} summaries")
    return "\n\n".join(f"{p}\n{BEGIN}{s}{END}" for p, s in zip(paragraphs, summaries))


def split_augmented(text: str) -> list[tuple[str, bool]]:
    """An augmented solution as (text, is_delimiter) pieces in order: the delimiters are what must be
    tokenized as the special tokens, everything else is plain text."""
    pieces = re.split(f"({re.escape(BEGIN)}|{re.escape(END)})", text)
    return [(p, p in (BEGIN, END)) for p in pieces if p]


@dataclass
class Augmented:
    """One augmented trace (a line of ``augmented.jsonl``).

    Attributes:
        index: the row's 0-based number among DATA's rows; problem: the problem text;
        paragraphs, summaries: aligned lists; rejected: per paragraph, why the summarizer's own summary was
        replaced by :func:`fallback_summary` (``empty``/``longer``/``copy``), or None; augmented: the text
        :func:`insert_summaries` makes of them (the assistant turn trained on).
    """

    index: int
    problem: str
    paragraphs: list[str]
    summaries: list[str]
    rejected: list[str | None] = field(default_factory=list)
    augmented: str = ""

    def to_json(self) -> dict:
        return {"index": self.index, "problem": self.problem, "paragraphs": self.paragraphs,
                "summaries": self.summaries, "rejected": self.rejected, "augmented": self.augmented}

    @classmethod
    def from_json(cls, row: dict, where: str) -> "Augmented":
        """Raises: UserError: a row that is not an augmented trace (missing or ill-typed fields)."""
        try:
            a = cls(int(row["index"]), str(row["problem"]), list(row["paragraphs"]), list(row["summaries"]),
                    list(row.get("rejected") or [None] * len(row["paragraphs"])), str(row["augmented"]))
        except KeyError as e:
            raise UserError(f"{where}: not an augmented row (no {e.args[0]!r} field); "
                            "write one with zoomr finetune, or drop --augmented") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"{where}: not an augmented row ({e}); "
                            "write one with zoomr finetune, or drop --augmented") from None
        if not a.augmented.strip():
            raise UserError(f"{where}: an augmented row has empty 'augmented' text")
        return a


def augment_trace(index: int, problem: str, solution: str, summarize: Callable[[list[str]], list[str]],
                  count_tokens: Callable[[str], int] | None = None,
                  target_tokens: int = DEFAULT_PARAGRAPH_TOKENS) -> Augmented:
    """One trace augmented: cleaned, split, its paragraphs summarized by ``summarize(paragraphs)`` (one raw
    model text per paragraph, each from that paragraph alone; cleaned by :func:`clean_summary`), rejected
    summaries replaced.

    Raises:
        UserError: a solution with no text left after cleaning.
    """
    paragraphs = split_paragraphs(clean_solution(solution), count_tokens, target_tokens)
    if not paragraphs:
        raise UserError(f"DATA row {index + 1}: empty solution")
    raw = summarize(paragraphs)
    if len(raw) != len(paragraphs):
        raise ValueError(f"the summarizer returned {len(raw)} summaries for {len(paragraphs)} paragraphs")
    summaries, rejected = [], []
    for p, r in zip(paragraphs, raw):
        s = clean_summary(r)
        why = check_summary(s, p)
        rejected.append(why)
        summaries.append(fallback_summary(p) if why else s)
    return Augmented(index, problem, paragraphs, summaries, rejected, insert_summaries(paragraphs, summaries))


def read_jsonl(path: Path, what: str = "DATA", limit: int | None = None) -> Iterator[dict]:
    """Rows of a JSONL file (blank lines skipped), at most ``limit``.

    Raises:
        UserError: no such file, a directory, not UTF-8 text, a line that is not a JSON object, no rows.
    """
    if not path.exists():
        raise UserError(f"{what} {path}: no such file")
    if not path.is_file():
        raise UserError(f"{what} {path}: not a file")
    n = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and n >= limit:
                break
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise UserError(f"{what} {path}: line {lineno} is not UTF-8 text (expected JSONL)") from None
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{what} {path}: line {lineno} is not JSON ({e.msg}); expected one JSON object "
                                "per line") from None
            if not isinstance(row, dict):
                raise UserError(f"{what} {path}: line {lineno} is a JSON {type(row).__name__}, not an object")
            n += 1
            yield row
    if n == 0:
        raise UserError(f"{what} {path}: no rows (empty file)")


def read_traces(path: Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(problem, solution) pairs of a trace file (:func:`read_jsonl`, :func:`detect_fields` on each row).

    Raises:
        UserError: see :func:`read_jsonl` and :func:`detect_fields`; also a problem or solution that is blank.
    """
    out = []
    for k, row in enumerate(read_jsonl(path, "DATA", limit)):
        prob, sol = detect_fields(row, f"DATA {path}: row {k + 1}")
        if not row[prob].strip() or not row[sol].strip():
            raise UserError(f"DATA {path}: row {k + 1} has an empty {prob} or {sol}")
        out.append((row[prob], row[sol]))
    return out


def rejection_counts(rows: Iterable[Augmented]) -> dict[str, int]:
    """Paragraphs and rejected summaries over ``rows``: ``{"paragraphs": n, "rejected": r, "empty": ...,
    "longer": ..., "copy": ...}``."""
    counts = {"paragraphs": 0, "rejected": 0, "empty": 0, "longer": 0, "copy": 0}
    for a in rows:
        counts["paragraphs"] += len(a.paragraphs)
        for why in a.rejected:
            if why:
                counts["rejected"] += 1
                counts[why] = counts.get(why, 0) + 1
    return counts
