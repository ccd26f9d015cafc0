"""A bench folder has one writer and honest readers: the folder lock (held by another process, freed by its
death), records read once per key with the duplicates named, a torn last line dropped with a note, and every
other file replaced whole (a concurrent reader never sees half of one)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import zoomr
from conftest import ENV, ROOT
from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.atomic import TEMP_PREFIX, replacing, write_atomic
from zoomr.evaluation.bench_plan import plan_bench
from zoomr.evaluation.datasets import load_problems
from zoomr.evaluation.folder_lock import HOLDER_NAME, LOCK_NAME, FolderBusy, FolderLock, read_holder
from zoomr.evaluation.records import RecordLog, write_config
from zoomr.evaluation.runner import bench_options

# a child that takes the lock, says so on stdout and sleeps until killed
HOLD = ("import sys, time; from pathlib import Path; from zoomr.evaluation.folder_lock import FolderLock; "
        "lock = FolderLock.acquire(Path(sys.argv[1]), ['zoomr', 'bench', '--out', sys.argv[1]]); "
        "print('locked', flush=True); time.sleep(600)")


def _holder(folder: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=ENV,
                         cwd=ROOT)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_lock_held_by_another_process_is_refused_naming_it_and_dies_with_it(tmp_path):
    p = _holder(tmp_path)
    try:
        with pytest.raises(FolderBusy) as e:
            FolderLock.acquire(tmp_path)
        msg = str(e.value)
        assert f"--out {tmp_path}: another bench is writing there: pid {p.pid} on {socket.gethostname()}" in msg
        assert "zoomr bench --out" in msg and "\n" not in msg
        assert e.value.holder["pid"] == p.pid
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # kill -9 leaves the files, never the lock
    assert (tmp_path / LOCK_NAME).exists() and read_holder(tmp_path)["pid"] == p.pid
    with FolderLock.acquire(tmp_path) as lock:
        assert lock.enforced and lock.note is None
        assert read_holder(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists() and not (tmp_path / HOLDER_NAME).exists()


def test_two_benches_of_one_process_exclude_each_other(tmp_path):
    with FolderLock.acquire(tmp_path):
        with pytest.raises(FolderBusy, match=f"pid {os.getpid()} "):
            FolderLock.acquire(tmp_path)
    FolderLock.acquire(tmp_path).release()   # free again once released


def test_a_refused_run_with_no_holder_file_says_so(tmp_path):
    """The moment between a holder's flock and its holder file (or a file its dead predecessor left)."""
    p = _holder(tmp_path)
    try:
        (tmp_path / HOLDER_NAME).unlink()
        with pytest.raises(FolderBusy, match="another process \\(it has not recorded its pid yet\\)"):
            FolderLock.acquire(tmp_path)
    finally:
        p.kill()
        p.wait()


def _record(pid: str, policy: str = "full", budget=None, **extra) -> dict:
    return {"problem_id": pid, "policy": policy, "budget": budget, "budget_tokens": budget, "gold": "3",
            "correct": True, "mean_active_tokens": 9, "peak_active_tokens": 9, "tokens_generated": 4, **extra}


def test_a_key_recorded_twice_is_read_once_and_named(tmp_path):
    path = tmp_path / "records.jsonl"
    rows = [_record("0"), _record("0", "rkv", 16, correct=False), _record("0", "rkv", 16), _record("1"),
            _record("0")]
    data = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(data)
    log = RecordLog(path)
    assert log.records == [rows[0], rows[1], rows[3]]   # the first of each key
    assert log.duplicates == [("0", "rkv", 16), ("0", "full", None)]
    (note,) = log.notes()
    assert note == (f"{path}: 2 cell(s) recorded more than once (problem 0 rkv B=16, problem 0 full; two runs "
                    "wrote this folder at once): the first record of each is used, the file keeps them all")
    assert path.read_text() == data   # nothing is rewritten


def test_a_torn_last_line_is_dropped_with_a_note(tmp_path):
    path = tmp_path / "records.jsonl"
    whole = json.dumps(_record("0")) + "\n"
    path.write_text(whole + json.dumps(_record("1"))[:17])
    log = RecordLog(path)
    assert log.records == [_record("0")] and log.torn_bytes == 17 and path.read_text() == whole
    assert log.notes() == [f"{path}: dropped a torn last line (17 bytes: a write cut off mid-line); every "
                           "complete record is kept"]
    assert RecordLog(path).notes() == []   # said once: the file is whole now


def _finished_folder(tmp_path: Path, records: list[dict]) -> Path:
    _, (problem,) = load_problems("gsm8k", 1)
    out = tmp_path / "b"
    plan = plan_bench(bench_options(None, {}), ["full"], None, dataset="gsm8k", limit=1, out=out,
                      match_budget=False, fidelity=True, n_parallel=1, rescue=None)
    out.mkdir()
    write_config(out / "config.json", plan.config)
    (out / "records.jsonl").write_text("".join(json.dumps({**r, "problem_id": problem.id}) + "\n" for r in records))
    return out


def test_resume_and_summary_of_a_folder_with_a_duplicated_key(tmp_path):
    """A folder an older version let two runs write: --resume runs nothing twice, the summary counts each cell
    once, and the warning names the key once (not again when the summary re-reads the file)."""
    out = _finished_folder(tmp_path, [_record("x", correct=True), _record("x", correct=False)])
    before = (out / "records.jsonl").read_bytes()
    events = []
    result = zoomr.bench(policies="full", limit=1, out=out, resume=True, on_event=events.append,
                         on_record=lambda r: pytest.fail("no cell runs"))
    pid = result["records"][0]["problem_id"]
    assert len(result["warnings"]) == 1 and f"(problem {pid} full;" in result["warnings"][0]
    assert [e.text for e in events if isinstance(e, ev.Warning)] == result["warnings"]
    (row,) = json.loads((out / "summary.json").read_text())["rows"]
    assert row["problems"] == 1 and row["accuracy"] == 1.0   # the first record, once
    assert (out / "records.jsonl").read_bytes() == before
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.startswith(TEMP_PREFIX)] and LOCK_NAME not in left and HOLDER_NAME not in left


def test_a_bench_refuses_a_folder_another_process_holds_before_reading_it(tmp_path):
    out = _finished_folder(tmp_path, [_record("x")])
    with open(out / "records.jsonl", "a") as f:
        f.write('{"problem_id": "torn')   # a reader would cut this off: the refused run must not
    before = (out / "records.jsonl").read_bytes()
    p = _holder(out)
    try:
        with pytest.raises(FolderBusy, match=f"pid {p.pid} "):
            zoomr.bench(policies="full", limit=1, out=out, resume=True)
    finally:
        p.kill()
        p.wait()
    assert (out / "records.jsonl").read_bytes() == before and not (out / "summary.json").exists()


def test_replacing_keeps_the_old_file_on_an_error_and_the_extension(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name.startswith(TEMP_PREFIX)
            tmp.write_bytes(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [path]
    umask = os.umask(0o022)
    os.umask(umask)
    write_atomic(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_reader_never_sees_half_a_file(tmp_path):
    """One thread rewrites a 1 MB summary 15 times while another reads it: every read is whole JSON (a plain
    ``write_text`` truncates first, so such a reader sees an empty or half file)."""
    path = tmp_path / "summary.json"
    write_atomic(path, json.dumps({"rows": [0] * 300_000}))
    stop, bad = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except ValueError as e:
                bad.append(str(e))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(15):
            write_atomic(path, json.dumps({"rows": [i] * 300_000}))
    finally:
        stop.set()
        reader.join()
    assert not bad, bad[:3]
