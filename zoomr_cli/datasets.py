"""Math test sets for ``zoomr bench``: a name (gsm8k, math500, aime24, amc23, olympiadbench), a JSONL path,
or a hub data set id; each record mapped to (id, question, gold answer).

Field layouts follow the published sets (see ../shared/data/README.md): GSM8K's gold is after ``####``;
OlympiadBench's ``final_answer`` is a list written as text; MATH500, AIME24 and AMC23 carry ``answer``.
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .grading import last_boxed

KNOWN = ("gsm8k", "math500", "aime24", "amc23", "olympiadbench")


@dataclass(frozen=True)
class Problem:
    """One benchmark item: a stable id (for resume), the question text and the gold answer (LaTeX or number)."""

    id: str
    question: str
    gold: str


class DatasetError(ValueError):
    """A data set name, file or record that cannot be used."""


def _data_dirs() -> list[Path]:
    """Where data set names are looked up: $ZOOMR_DATA, ./data, ../shared/data (this repo's sibling), cwd's."""
    dirs = [Path(p) for p in os.environ.get("ZOOMR_DATA", "").split(os.pathsep) if p]
    repo = Path(__file__).resolve().parents[1]
    return dirs + [Path.cwd() / "data", repo / "data", repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]


def _gold(rec: dict) -> str:
    if rec.get("final_answer") is not None:  # OlympiadBench: "['2']" or a list
        fa = rec["final_answer"]
        if isinstance(fa, str):
            try:
                fa = ast.literal_eval(fa)
            except (ValueError, SyntaxError):
                return fa.strip()
        return ", ".join(str(x).strip() for x in fa) if isinstance(fa, (list, tuple)) else str(fa)
    if rec.get("answer") is not None:
        ans = rec["answer"]
        if isinstance(ans, str) and "####" in ans:  # GSM8K worked solution
            return ans.rsplit("####", 1)[1].strip().replace(",", "")
        if isinstance(ans, float) and ans.is_integer():  # AMC23 stores 27.0
            return str(int(ans))
        return str(ans).strip()
    if "solution" in rec:
        boxed = last_boxed(str(rec["solution"]))
        if boxed is not None:
            return boxed
    raise DatasetError("record has no answer, final_answer or boxed solution field")


def _question(rec: dict) -> str:
    for key in ("problem", "question", "prompt", "input"):
        if isinstance(rec.get(key), str) and rec[key].strip():
            q = rec[key].strip()
            if rec.get("context"):  # OlympiadBench shared context
                q = f"{str(rec['context']).strip()}\n\n{q}"
            return q
    if any(key in rec for key in ("problem", "question", "prompt", "input")):
        raise DatasetError("the problem/question field is empty or not text")
    raise DatasetError("record has no problem/question/prompt field")


def parse_records(lines, source: str) -> list[Problem]:
    """Problems from JSONL lines.

    Raises:
        DatasetError: a line is not JSON or lacks a question/answer, naming ``source`` and the line.
    """
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise DatasetError(f"expected a JSON object per line, got {type(rec).__name__}")
            pid = str(rec.get("id", rec.get("unique_id", n - 1)))
            out.append(Problem(id=pid, question=_question(rec), gold=_gold(rec)))
        except (json.JSONDecodeError, DatasetError, AttributeError) as e:
            raise DatasetError(f"{source}:{n}: {e}") from None
    if not out:
        raise DatasetError(f"{source}: no problems")
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):  # ids must be unique for resume: fall back to line numbers
        out = [Problem(str(i), p.question, p.gold) for i, p in enumerate(out)]
    return out


def load_problems(spec: str, limit: int | None = None) -> tuple[str, list[Problem]]:
    """Resolve ``spec`` and read its problems (first ``limit`` of them).

    Args:
        spec: a known name, a ``.jsonl`` path, or a hub data set id ``owner/name`` (its JSONL test split).
    Returns:
        (display name, problems).
    Raises:
        DatasetError: nothing found, unreadable, or malformed.
    """
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}")
    path = Path(spec).expanduser()
    name = path.stem
    if not path.is_file() and spec in KNOWN:
        found = [d / spec / "test.jsonl" for d in _data_dirs() if (d / spec / "test.jsonl").is_file()]
        if not found:
            raise DatasetError(f"data set {spec!r}: no {spec}/test.jsonl under $ZOOMR_DATA, ./data or ../shared/data")
        path, name = found[0], spec
    elif not path.is_file() and re.match(r"^[\w.\-]+/[\w.\-]+$", spec):
        path, name = _hub_jsonl(spec), spec
    elif not path.is_file():
        raise DatasetError(f"{spec}: no such data set name or JSONL file (names: {', '.join(KNOWN)})")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read ({e})") from None
    problems = parse_records(lines, str(path))
    return name, problems[:limit] if limit else problems


def _hub_jsonl(repo_id: str) -> Path:
    """The test-split JSONL of a hub data set (cached; downloaded only when not offline)."""
    from huggingface_hub import snapshot_download

    kwargs = dict(repo_type="dataset", allow_patterns=["*.jsonl", "**/*.jsonl"])
    try:
        root = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except Exception:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
            raise DatasetError(f"{repo_id}: not in the local hub cache and HF_HUB_OFFLINE is set") from None
        try:
            root = Path(snapshot_download(repo_id, **kwargs))
        except Exception as e:
            raise DatasetError(f"{repo_id}: cannot download the data set ({type(e).__name__})") from None
    files = sorted(root.rglob("*.jsonl"), key=lambda p: ("test" not in p.name, str(p)))
    if not files:
        raise DatasetError(f"{repo_id}: the data set has no JSONL files")
    return files[0]
