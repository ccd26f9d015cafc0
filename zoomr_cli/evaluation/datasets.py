"""Math test sets for ``zoomr bench``: a name (gsm8k, math500, aime24, amc23, olympiadbench), a JSONL path
(``.jsonl`` or ``.jsonl.gz``), or a hub data set id; each record mapped to (id, question, gold answer).

A name is looked up as ``<dir>/<name>/test.jsonl`` in each ``$ZOOMR_DATA`` folder (``os.pathsep``-separated),
then in the copies shipped inside this package (``data/<name>.jsonl.gz``, provenance in ``data/README.md``),
found through ``importlib.resources`` so an installed zoomr needs no checkout beside it.

Field layouts follow the published sets: GSM8K's gold is after ``####``; OlympiadBench's ``final_answer`` is a
list written as text; MATH500, AIME24 and AMC23 carry ``answer``.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from zoomr.errors import check_text
from zoomr.grading import last_boxed

KNOWN = ("gsm8k", "math500", "aime24", "amc23", "olympiadbench")
SHIPPED = "shipped"
# the first of these that holds text is the question (OlympiadBench adds a shared ``context``)
QUESTION_KEYS = ("problem", "question", "prompt", "input")
_NAME = re.compile(r"^[\w.\-]+$")  # one path component: a data set name, never a hub id or a path


@dataclass(frozen=True)
class Problem:
    """One benchmark item: a stable id (for resume), the question text and the gold answer (LaTeX or number)."""

    id: str
    question: str
    gold: str


class DatasetError(ValueError):
    """A data set name, file or record that cannot be used."""


def _data_dirs() -> list[Path]:
    """The ``$ZOOMR_DATA`` folders, in order; they override the shipped copies."""
    return [Path(p).expanduser() for p in os.environ.get("ZOOMR_DATA", "").split(os.pathsep) if p]


def _shipped(name: str):
    """The packaged copy of a known set (a ``Traversable``; it may sit in a zip), or None."""
    f = resources.files(__package__) / "data" / f"{name}.jsonl.gz"
    return f if f.is_file() else None


def _locate(name: str):
    """(source label, file) of a data set name: the first ``$ZOOMR_DATA`` hit (label: its path), else the
    shipped copy (label ``"shipped"``); None when neither has it."""
    if not _NAME.match(name):
        return None
    for d in _data_dirs():
        f = d / name / "test.jsonl"
        if f.is_file():
            return str(f), f
    shipped = _shipped(name) if name in KNOWN else None
    return (SHIPPED, shipped) if shipped is not None else None


# Largest data set read (bytes of JSONL, after gunzip): the test sets are a few MB; the bound keeps a corrupt
# or hostile .jsonl.gz (a few KB that inflate to many GB) from exhausting memory. Reading peaks at about
# four times the JSONL bytes (the bytes, their text, its lines, the problems), under eight at worst.
MAX_DATASET_BYTES = 1 << 30
_CHUNK = 1 << 20


def _read_lines(f) -> list[str]:
    """Text lines of a JSONL file (``Path`` or ``Traversable``), gunzipped when its name ends in ``.gz``.

    Lines end at ``\\n`` only (a ``\\r`` before it is JSON whitespace): U+2028 and the other separators
    :meth:`str.splitlines` also splits at may stand unescaped inside a JSON string. A leading byte-order
    mark is dropped.

    Raises:
        DatasetError: unreadable, a broken gzip stream, not UTF-8, or more than :data:`MAX_DATASET_BYTES`.
    """
    try:
        with f.open("rb") as raw, (gzip.GzipFile(fileobj=raw) if f.name.endswith(".gz") else raw) as src:
            # read (and inflated) in chunks: the bound holds before the memory is spent
            parts, size = [], 0
            while size <= MAX_DATASET_BYTES and (part := src.read(_CHUNK)):
                parts.append(part)
                size += len(part)
        if size > MAX_DATASET_BYTES:
            raise DatasetError(f"{f}: more than {MAX_DATASET_BYTES} bytes of JSONL, the limit of a data set")
        data = b"".join(parts)
        del parts
        return data.decode("utf-8-sig").split("\n")
    except UnicodeDecodeError as e:  # the byte offset, as a problem file's refusal gives it
        raise DatasetError(f"{f}: not valid UTF-8 (byte {e.start}): not a JSONL data set") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"{f}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def _worked_solution(ans) -> bool:
    """GSM8K's ``answer`` is a worked solution ending in ``#### <number>``."""
    return isinstance(ans, str) and "####" in ans


def _gold_key(rec: dict) -> str | None:
    """The field the gold answer comes from, in order of precedence; None when the record has none."""
    for key in ("final_answer", "answer"):
        if rec.get(key) is not None:
            return key
    return "solution" if "solution" in rec else None


def _gold(rec: dict) -> str:
    key = _gold_key(rec)
    if key == "final_answer":  # OlympiadBench: "['2']" or a list
        fa = rec["final_answer"]
        if isinstance(fa, str):
            try:
                fa = ast.literal_eval(fa)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # not a literal: the text
                return fa.strip()
        return ", ".join(str(x).strip() for x in fa) if isinstance(fa, (list, tuple)) else str(fa)
    if key == "answer":
        ans = rec["answer"]
        if _worked_solution(ans):
            return ans.rsplit("####", 1)[1].strip().replace(",", "")
        if isinstance(ans, float) and ans.is_integer():  # AMC23 stores 27.0
            return str(int(ans))
        return str(ans).strip()
    if key == "solution":
        boxed = last_boxed(str(rec["solution"]))
        if boxed is not None:
            return boxed
    raise DatasetError("record has no answer, final_answer or boxed solution field")


def _question_key(rec: dict) -> str | None:
    """The first of :data:`QUESTION_KEYS` that holds non-empty text, or None."""
    return next((k for k in QUESTION_KEYS if isinstance(rec.get(k), str) and rec[k].strip()), None)


def _question(rec: dict) -> str:
    key = _question_key(rec)
    if key is not None:
        q = rec[key].strip()
        if rec.get("context"):  # OlympiadBench shared context
            q = f"{str(rec['context']).strip()}\n\n{q}"
        return q
    if any(key in rec for key in QUESTION_KEYS):
        raise DatasetError("the problem/question field is empty or not text")
    raise DatasetError("record has no problem/question/prompt field")


def parse_records(lines, source: str) -> list[Problem]:
    """Problems from JSONL lines.

    Raises:
        DatasetError: a line is not JSON (or nested too deeply, or holds an integer of more than 4300 digits),
            lacks a question/answer, or holds text that is not valid Unicode; naming ``source`` and the line.
    """
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            try:
                rec = json.loads(line)
            except RecursionError:
                raise DatasetError("JSON nested too deeply") from None
            except json.JSONDecodeError as e:
                raise DatasetError(f"not JSON ({e.msg} at column {e.colno}); expected one JSON object per line, "
                                   "e.g. {\"question\": ..., \"answer\": ...}") from None
            except ValueError:
                raise DatasetError("a number of more than 4300 digits (Python's limit)") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"expected a JSON object per line, got {type(rec).__name__}")
            pid = str(rec.get("id", rec.get("unique_id", n - 1)))
            problem = Problem(id=check_text(pid, "the id"), question=check_text(_question(rec), "the question"),
                              gold=check_text(_gold(rec), "the answer"))
            out.append(problem)
        except (ValueError, AttributeError) as e:  # JSON errors and the checks above
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
        spec: a JSONL file (``.jsonl`` or gzipped ``.jsonl.gz``), a data set name (``$ZOOMR_DATA`` first,
            then the shipped copy, see the module docstring), or a hub data set id ``owner/name`` (its JSONL
            test split).
    Returns:
        (display name, problems).
    Raises:
        DatasetError: nothing found, unreadable, or malformed.
    """
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}")
    path = Path(spec).expanduser()
    if path.is_file():
        f, name = path, Path(path.name.removesuffix(".gz")).stem
    elif spec.strip() and path.is_dir():   # Path("") is "."
        raise DatasetError(f"{spec}: is a folder; --dataset takes a name ({', '.join(KNOWN)}) or a JSONL file")
    elif (found := _locate(spec)) is not None:
        f, name = found[1], spec
    elif spec in KNOWN:  # only a broken install lacks its shipped copy
        raise DatasetError(f"data set {spec!r}: no {spec}/test.jsonl under $ZOOMR_DATA and no shipped copy "
                           "in this install (reinstall zoomr)")
    elif re.match(r"^[\w.\-]+/[\w.\-]+$", spec):
        f, name = _hub_jsonl(spec), spec
    else:
        raise DatasetError(f"{spec}: no such data set name or JSONL file (names: {', '.join(KNOWN)}; "
                           "zoomr bench --list-datasets shows them)")
    problems = parse_records(_read_lines(f), str(f))
    return name, problems[:limit] if limit else problems


def records(name: str) -> list[dict]:
    """The raw JSON records of a data set name, resolved as :func:`load_problems` does (for fields it does
    not map, e.g. MATH500's worked ``solution``).

    Raises:
        DatasetError: an unknown name, or an unreadable or malformed file.
    """
    found = _locate(name)
    if found is None:
        raise DatasetError(f"data set {name!r}: not under $ZOOMR_DATA and not shipped (names: {', '.join(KNOWN)})")
    f = found[1]
    try:
        return [json.loads(line) for line in _read_lines(f) if line.strip()]
    except (ValueError, RecursionError) as e:
        raise DatasetError(f"{f}: {e}") from None


def _fields(lines: list[str]) -> tuple[str, str]:
    """(question field, gold field) that :func:`parse_records` reads a set's records from (call it first: it
    rejects records without them); several layouts in one file are joined by ``/``."""
    qs, gs = [], []
    for line in lines:
        if line.strip():
            rec = json.loads(line)
            q, g = _question_key(rec), _gold_key(rec)
            q = f"{q} (+context)" if rec.get("context") else q
            g = "answer (after ####)" if g == "answer" and _worked_solution(rec[g]) else g
            g = "solution (last \\boxed)" if g == "solution" else g
            qs += [q] if q not in qs else []
            gs += [g] if g not in gs else []
    return "/".join(qs), "/".join(gs)


def list_datasets() -> list[dict]:
    """Every data set a name resolves to here: the known sets, then other ``<name>/test.jsonl`` folders of
    ``$ZOOMR_DATA`` (sorted).

    Returns:
        One dict per set: ``name``, ``problems`` (count), ``source`` (``"shipped"`` or the ``$ZOOMR_DATA``
        file that wins), ``question`` and ``gold`` (the record fields they are read from).
    Raises:
        DatasetError: a set that cannot be read or parsed (its file and line named).
    """
    extra = sorted({d.name for root in _data_dirs() if root.is_dir() for d in root.iterdir()
                    if d.name not in KNOWN and (d / "test.jsonl").is_file() and _NAME.match(d.name)})
    rows = []
    for name in (*KNOWN, *extra):
        found = _locate(name)
        if found is None:
            continue
        source, f = found
        lines = _read_lines(f)
        problems = parse_records(lines, str(f))  # first: a malformed line is named before _fields reads it
        question, gold = _fields(lines)
        rows.append({"name": name, "problems": len(problems), "source": source, "question": question,
                     "gold": gold})
    return rows


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
