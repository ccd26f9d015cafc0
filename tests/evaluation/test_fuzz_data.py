"""Fuzzing what ``zoomr bench`` reads back: JSONL data sets (``--dataset FILE``) and an ``--out`` folder's
``records.jsonl`` and ``config.json`` (``--resume``).

Data sets: real lines of the shipped sets, mutated as bytes (cut, inserted, deleted: torn lines, invalid
UTF-8, NUL bytes, stray line ends), as JSON (a field replaced by a wrong type, a huge number, deep nesting,
an escaped lone surrogate, or dropped) and as gzip (the stream's bytes flipped or cut). The property: a list
of Problems whose texts are valid Unicode, or one DatasetError line naming the file; nothing else raised.

Records: a folder's log, written by :class:`RecordLog` itself, then torn at the end (a crash mid-write),
given garbage or wrongly typed lines, or cut anywhere. The property: a refusal in one line that leaves the
file as it was, or a resume that keeps every complete earlier line byte for byte, drops only a torn tail
that is no record, and appends after it; and the summary of what was read never fails.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import tracemalloc
from importlib import resources

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import ENV, ROOT, assert_one_line_error, zoomr, zoomr_cmd
from fuzzing import Tally, fuzz_settings, one_line, time_limit
from zoomr.evaluation import datasets
from zoomr.evaluation.datasets import KNOWN, DatasetError, load_problems, records
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.records import REQUIRED, RecordLog, read_config

DATASET_EXAMPLES, RECORD_EXAMPLES, CONFIG_EXAMPLES = 250, 200, 100
LIMIT_S = 5

# Raw JSON values a field may be replaced with: wrong types, the limits of Python's JSON reader, lone
# surrogate escapes, texts ast.literal_eval chokes on (OlympiadBench's final_answer is parsed with it).
RAW_VALUES = ["null", "true", "0", "-1", "1e999", "NaN", "-Infinity", "[]", "{}", '""', '"   "', '"x"',
              '"\\ud800"', '"a\\udfffb"', '"\\u0000"', '"\\u2028"', "9" * 5000, "9" * 4000, "-" + "9" * 4300,
              "[" * 5000 + "]" * 5000, "[" * 900 + "]" * 900, '{"a": ' * 3000 + "1" + "}" * 3000,
              '"{[]: 1}"', '"((((("', '"[[[[[[1]]]]]]"', '"9' + "9" * 5000 + '"', '"[1, [2, (3,)]]"',
              '"#### 12,000"', '"\\\\boxed{"', '"\\\\boxed{\\\\boxed{}}"', '[1, "a", null]', '{"x": [1]}']
FIELDS = ["question", "problem", "prompt", "input", "answer", "final_answer", "solution", "context", "id",
          "unique_id"]
BYTE_PIECES = [b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\n", b"\r\n", b"\r", b"{", b"}", b"[", b'"', b",",
               b"\\", b"\xef\xbb\xbf", "\u2028".encode(), "\u0085".encode(), b"\x1e", b" "]


def shipped_lines() -> list[str]:
    """The first records of every shipped set, as JSON lines (some with their non-ASCII text unescaped)."""
    out = []
    for name in KNOWN:
        for i, rec in enumerate(records(name)[:2]):
            out.append(json.dumps(rec, ensure_ascii=bool(i)))
    out.append(json.dumps({"question": "a\u2028b\u2029c\x85d: 1+1?", "answer": "#### 2"}, ensure_ascii=False))
    return out


BASE_LINES = shipped_lines()

_json_edit = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 20), st.sampled_from(FIELDS), st.sampled_from(RAW_VALUES)),
    st.tuples(st.just("drop"), st.integers(0, 20), st.sampled_from(FIELDS)),
    st.tuples(st.just("wrap"), st.integers(0, 20)),
)
_byte_edit = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.sampled_from(BYTE_PIECES) | st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 40)),
)


def edit_line(line: str, edit) -> str:
    """``line`` (a JSON object) with one field set to a raw JSON value, dropped, or the object in a list."""
    if edit[0] == "wrap":
        return f"[{line}]"
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # an earlier edit made it no JSON: leave it so
        return line
    if not isinstance(rec, dict):
        return line
    key = edit[2]
    rec.pop(key, None)
    if edit[0] == "drop":
        return json.dumps(rec)
    body = json.dumps(rec)[:-1]
    return body + (", " if rec else "") + f'"{key}": {edit[3]}' + "}"


def edit_bytes(data: bytes, edit) -> bytes:
    at = int(edit[1] * len(data))
    if edit[0] == "cut":
        return data[:at]
    if edit[0] == "insert":
        return data[:at] + edit[2] + data[at:]
    return data[:at] + data[at + edit[2]:]


# (lines picked, JSON edits, byte edits, gzipped, a gzip byte flipped, the gzip stream cut)
DATASET_INPUTS = (st.lists(st.sampled_from(range(len(BASE_LINES))), min_size=1, max_size=6),
                  st.lists(_json_edit, max_size=3), st.lists(_byte_edit, max_size=3), st.booleans(),
                  st.none() | st.tuples(st.floats(0, 1), st.integers(0, 255)), st.none() | st.floats(0, 1))


def dataset_file(tmp_path, picks, json_edits, byte_edits, gz, flip, gz_cut):
    lines = [BASE_LINES[i] for i in picks]
    for e in json_edits:
        lines[e[1] % len(lines)] = edit_line(lines[e[1] % len(lines)], e)
    data = ("\n".join(lines) + "\n").encode("utf-8")
    for e in byte_edits:
        data = edit_bytes(data, e)
    path = tmp_path / ("data.jsonl.gz" if gz else "data.jsonl")
    if gz:
        data = bytearray(gzip.compress(data, mtime=0))
        if flip is not None:
            data[int(flip[0] * (len(data) - 1))] ^= flip[1] or 1
        if gz_cut is not None:
            data = data[:int(gz_cut * len(data))]
    path.write_bytes(bytes(data))
    return path


def test_fuzz_jsonl_datasets(tmp_path):
    """Mutated JSONL data sets (plain and gzipped): Problems with valid texts, or one DatasetError line."""
    tally = Tally("JSONL data sets")

    @fuzz_settings(DATASET_EXAMPLES)
    @given(*DATASET_INPUTS)
    @example(list(range(len(BASE_LINES))), [], [], False, None, None)  # every base line as it is: all load
    @example(list(range(len(BASE_LINES))), [], [], True, None, None)
    @example([0], [("set", 0, "answer", "[" * 5000 + "]" * 5000)], [], False, None, None)
    @example([0], [("set", 0, "answer", "9" * 5000)], [], False, None, None)
    @example([8], [("set", 0, "final_answer", '"{[]: 1}"')], [], False, None, None)
    @example([0], [("set", 0, "question", '"\\ud800"')], [], False, None, None)
    def one(picks, json_edits, byte_edits, gz, flip, gz_cut):
        path = dataset_file(tmp_path, picks, json_edits, byte_edits, gz, flip, gz_cut)
        try:
            with time_limit(LIMIT_S):
                name, problems = load_problems(str(path))
        except DatasetError as e:
            msg = one_line(str(e), str(path))
            kind = re.sub(r"\d+", "N", msg[len(str(path)):].split(" (")[0].split(": ")[-1])[:40]
            tally[f"refused: {kind}"] += 1
            return
        assert name == "data" and problems
        assert len({p.id for p in problems}) == len(problems)
        for p in problems:
            assert all(isinstance(t, str) for t in (p.id, p.question, p.gold)) and p.question.strip()
            (p.id + p.question + p.gold).encode("utf-8")  # no lone surrogate: tokenizable and recordable
        if not (json_edits or byte_edits or flip or gz_cut is not None):
            assert len(problems) == len(picks)  # an unmutated file loads whole, U+2028 lines included
        tally["loaded"] += 1

    one()
    tally.report()
    assert tally["loaded"] and sum(v for k, v in tally.items() if k.startswith("refused")) > 50


def test_a_gzip_bomb_is_refused_within_the_memory_bound(tmp_path, monkeypatch):
    """Memory bound: a .jsonl.gz is inflated in chunks up to MAX_DATASET_BYTES, never whole: 64 MiB of
    inflated data against a 1 MiB limit is refused holding the limit, the 1 MiB chunk read past it and gzip's
    own buffers: under 6 MiB, not 64."""
    monkeypatch.setattr(datasets, "MAX_DATASET_BYTES", 1 << 20)
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(b" " * (64 << 20), compresslevel=9))
    tracemalloc.start()
    try:
        with pytest.raises(DatasetError) as e:
            load_problems(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_line(str(e.value), f"{path}: more than 1048576 bytes of JSONL")
    assert peak < 6 << 20, peak


@pytest.mark.parametrize("name", ["gsm8k", "olympiadbench"])
def test_reading_a_dataset_holds_under_eight_copies(name):
    """Memory bound: reading a data set peaks under 8x its JSONL bytes (Python heap)."""
    size = len(gzip.decompress((resources.files("zoomr.evaluation") / "data" / f"{name}.jsonl.gz").read_bytes()))
    tracemalloc.start()
    try:
        load_problems(name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * size, (peak, size)


def test_cli_bad_dataset_is_one_line_exit_2(tmp_path):
    """A data set line nested 5000 deep (once a RecursionError, exit 1) is named in one line, exit 2."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "q", "answer": ' + "[" * 5000 + "]" * 5000
                    + "}\n")
    r = zoomr("bench", "--dataset", str(path), "--limit", "1", "-n", "4", "--policies", "full", "--no-live",
              "--out", str(tmp_path / "out"))
    assert_one_line_error(r)
    assert r.stderr.strip() == f"zoomr: error: {path}:2: JSON nested too deeply"


# --- bench records and config.json (--resume) ----------------------------------------------------------

def record(i: int, **extra) -> dict:
    """A record as a bench cell writes it (the fields the summary, table and plots read)."""
    return {"problem_id": str(i), "policy": ["full", "streaming", "zoomr"][i % 3], "budget": [None, 16, "matched"][i % 3],
            "budget_tokens": 16, "gold": "18", "answer": "18" if i % 2 else None, "correct": bool(i % 2),
            "answer_source": "boxed", "n_boxed_distinct": 1, "prompt_tokens": 60, "tokens_generated": 4,
            "stop_reason": "length", "no_answer_at_cap": not i % 2, "mean_active_tokens": 61.5 + i,
            "peak_active_tokens": 64, "bound_tokens": 64, "bound_measured": False, "mean_active_bytes": 1e6,
            "peak_active_bytes": 1100000, "full_tokens": 64, "full_bytes": 1100000, "mean_full_bytes": 1.05e6,
            "saving": 1.05, "saving_peak": 1.0, "device_kv_bytes": 2 ** 20, "host_kv_bytes": 0, "kv_device": "cpu",
            "decode_tok_s": 12.5, "prefill_tok_s": 100.0, "active_trace": [[0, 60], [4, 64]], "kv_extra": {},
            "text": f"Step {i}: 9 \u2028 × 2 = 18\r\n\u0085 so \\boxed{{18}} <|im_end|>", "wall_s": 0.5,
            "fidelity_top1": None if i % 3 == 0 else 0.75, "fidelity_kl": None if i % 3 == 0 else 0.1, **extra}


RECORD_RAW = ["null", "true", '"x"', "[1]", '{"a": 1}', "-1", "1.5", "NaN", "9" * 5000, "[" * 3000 + "]" * 3000,
              '"matched"', "[[0, 1], [2]]", "[[0, 1], [2, 3]]", '"\\ud800"']
_record_edit = st.one_of(
    st.tuples(st.just("torn"), st.floats(0, 1)),  # the last line cut mid-write
    st.tuples(st.just("no newline")),  # a whole last record without its line end
    st.tuples(st.just("garbage"), st.integers(0, 9), st.binary(max_size=12).filter(lambda b: b"\n" not in b)),
    st.tuples(st.just("field"), st.integers(0, 9), st.sampled_from(sorted(REQUIRED) + ["active_trace", "saving",
              "fidelity_kl", "peak_active_tokens", "decode_tok_s", "text"]), st.sampled_from(RECORD_RAW)),
    st.tuples(st.just("bytes"), st.floats(0, 1), st.sampled_from(BYTE_PIECES)),
    st.tuples(st.just("cut"), st.floats(0, 1)),
)


def mutate_records(data: bytes, edits) -> bytes:
    lines = data.split(b"\n")[:-1]
    for e in edits:
        if e[0] == "torn":
            last = json.dumps(record(len(lines)), ensure_ascii=False).encode()
            data = b"".join(line + b"\n" for line in lines) + last[:int(e[1] * len(last))]
        elif e[0] == "no newline":
            data = data.rstrip(b"\n")
        elif e[0] == "garbage":
            ls = data.split(b"\n")
            ls.insert(e[1] % len(ls), e[2])
            data = b"\n".join(ls)
        elif e[0] == "field":
            ls = data.split(b"\n")
            i = e[1] % len(ls)
            try:
                rec = json.loads(ls[i])
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                rec.pop(e[2], None)
                ls[i] = json.dumps(rec, ensure_ascii=False).encode()[:-1] + f', "{e[2]}": {e[3]}}}'.encode()
            data = b"\n".join(ls)
        elif e[0] == "bytes":
            data = edit_bytes(data, ("insert", e[1], e[2]))
        else:
            data = edit_bytes(data, e)
    return data


def is_record(line: bytes) -> bool:
    """A line the resume may keep: a JSON object with the required fields (its kinds checked by the log)."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and REQUIRED <= rec.keys()


def test_fuzz_resumed_records(tmp_path):
    """Mutated records.jsonl, opened for --resume, summarized and appended to: refused in one line with the
    file untouched, or every complete earlier line kept byte for byte and the new record after them."""
    path = tmp_path / "records.jsonl"
    base_log = tmp_path / "base.jsonl"
    log = RecordLog(base_log)
    for i in range(5):
        log.append(record(i))
    base = base_log.read_bytes()
    new = record(99, problem_id="new")
    new_line = (json.dumps(new, ensure_ascii=False) + "\n").encode()
    tally = Tally("bench records (--resume)")

    @fuzz_settings(RECORD_EXAMPLES)
    @given(st.lists(_record_edit, max_size=3))
    @example([])
    @example([("torn", 0.5)])
    @example([("no newline",)])
    @example([("garbage", 2, b"\xfe\xff"), ("torn", 0.3)])  # refused: the torn tail stays too
    @example([("field", 1, "text", '"a\\u2028b"')])
    def one(edits):
        before = mutate_records(base, edits)
        path.write_bytes(before)
        complete, tail = before[:before.rfind(b"\n") + 1], before[before.rfind(b"\n") + 1:]
        lines = [line for line in complete.split(b"\n")[:-1] if line.strip(b" \t\r")]
        try:
            with time_limit(LIMIT_S):
                log = RecordLog(path)
                summarize(log.records)
        except ValueError as e:
            one_line(str(e), str(path))
            assert path.read_bytes() == before, "a refused file was changed"
            tally["refused, file untouched"] += 1
            return
        assert all(is_record(line) for line in lines), "a line that is no record was accepted"
        kept_tail = len(log.records) == len(lines) + 1
        assert len(log.records) == len(lines) + kept_tail
        assert log.records[:len(lines)] == [json.loads(line) for line in lines]
        if kept_tail:
            assert is_record(tail) and log.records[-1] == json.loads(tail)
        elif tail.strip(b" \t\r"):  # dropped: only a torn write, which is never whole JSON
            with pytest.raises((ValueError, RecursionError)):
                json.loads(tail)
        log.append(new)
        after = path.read_bytes()
        assert after == complete + (tail + b"\n" if kept_tail else b"") + new_line, "earlier bytes changed"
        again = RecordLog(path)
        assert again.records == log.records and again.done == log.done
        tally["resumed, torn tail kept whole" if kept_tail else
              "resumed, torn tail dropped" if tail else "resumed"] += 1

    one()
    tally.report()
    assert tally["refused, file untouched"] and tally["resumed"] and tally["resumed, torn tail dropped"]
    assert tally["resumed, torn tail kept whole"]


CONFIG = {"dataset": "gsm8k", "model": "default", "backend": "torch", "n_predict": 4, "sampling": {"temp": 0.0},
          "provenance": {"model_sha256": "ab" * 32, "model_path": "/m.gguf", "packages": {"torch": "2"}}}


def test_fuzz_resumed_config(tmp_path):
    """Mutated config.json: the earlier run's settings (a dict whose provenance the resume can read), or
    one line naming the file."""
    path = tmp_path / "config.json"
    base = json.dumps(CONFIG, indent=2).encode()
    tally = Tally("bench config.json (--resume)")

    @fuzz_settings(CONFIG_EXAMPLES)
    @given(st.lists(_byte_edit | st.tuples(st.just("value"), st.sampled_from(["provenance", "model", "dataset"]),
                                           st.sampled_from(RECORD_RAW + ['{"model_sha256": 5}', '"abc"'])),
                    max_size=3))
    def one(edits):
        data = base
        for e in edits:
            if e[0] == "value":  # the last of two equal keys wins: add it at the end
                end = data.rfind(b"}")
                data = data if end < 0 else data[:end] + f', "{e[1]}": {e[2]}'.encode() + data[end:]
            else:
                data = edit_bytes(data, e)
        path.write_bytes(data)
        try:
            with time_limit(LIMIT_S):
                old = read_config(path)
        except ValueError as e:
            one_line(str(e), f"{path}: not a bench config")
            tally["refused"] += 1
            return
        prov = old.get("provenance") or {}
        assert isinstance(old, dict) and isinstance(prov, dict)
        assert all(isinstance(prov.get(k), (str, type(None))) for k in ("model_sha256", "model_path"))
        tally["read"] += 1

    one()
    tally.report()
    assert tally["read"] and tally["refused"]


@pytest.mark.slow
def test_cli_resume_after_a_torn_last_line_keeps_every_record(tmp_path):
    """A bench killed while writing its second record: --resume keeps the first byte for byte, drops the
    torn half line and runs the second cell again."""
    data, out = tmp_path / "two.jsonl", tmp_path / "out"
    data.write_text('{"question": "What is 2+2?", "answer": "4"}\n{"question": "What is 3+3?", "answer": "6"}\n')
    args = ["bench", "--dataset", str(data), "-n", "4", "--policies", "full", "--no-live", "--out", str(out)]
    r = subprocess.run(zoomr_cmd() + args + ["--limit", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    rec_path = out / "records.jsonl"
    first = rec_path.read_bytes()
    torn = first.replace(b'"problem_id": "0"', b'"problem_id": "1"')[: len(first) // 2]
    rec_path.write_bytes(first + torn)
    r = subprocess.run(zoomr_cmd() + args + ["--limit", "2", "--resume"], capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    after = rec_path.read_bytes()
    assert after.startswith(first) and after.count(b"\n") == 2 and torn not in after
    assert [json.loads(line)["problem_id"] for line in after.splitlines()] == ["0", "1"]
