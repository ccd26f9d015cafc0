"""Two ``zoomr bench`` processes on one ``--out``, as a user (or a scheduler's retry) starts them: the second stops
before its first cell (exit 2, one line naming the holder), with or without ``--resume``, and the records hold
each cell once; a holder killed with SIGKILL leaves no lock behind, so ``--resume`` then finishes the run."""

import json
import signal
import socket
import subprocess
import time
from collections import Counter

import pytest

from conftest import ENV, ROOT, assert_one_line_error, wait_for, zoomr_cmd
from zoomr.evaluation.bench_plan import plan_cells
from zoomr.evaluation.folder_lock import HOLDER_NAME, LOCK_NAME, read_holder

POLICIES = "full,rkv"
CELLS = len(plan_cells(POLICIES.split(","), [16]))
REFUSAL_S = 5.0   # the target: a second writer is refused within 5 s


def _cmd(out, limit: int, *extra) -> list[str]:
    return zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", str(limit), "-n", "24", "--budget", "16",
                          "--policies", POLICIES, "--no-live", "--out", str(out), *extra]


def _start(cmd) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)


def _refused(cmd, holder_pid: int, out) -> float:
    """Run ``cmd`` while ``holder_pid`` holds ``out``: it must exit 2 with one line naming the folder, the
    holder's pid and host. Returns its wall seconds."""
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    seconds = time.monotonic() - t
    assert_one_line_error(r)
    assert f"--out {out}: another bench is writing there: pid {holder_pid} on {socket.gethostname()}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return seconds


def _keys(out) -> Counter:
    lines = (out / "records.jsonl").read_text().splitlines()
    return Counter((j["problem_id"], j["policy"], j["budget"]) for j in map(json.loads, lines))


@pytest.mark.slow
def test_second_writer_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    out = tmp_path / "b"
    rec_path, holder_path = out / "records.jsonl", out / HOLDER_NAME

    # 1. the same command twice, the second while the first holds the folder and has written no record yet
    first = _start(_cmd(out, 1))
    wait_for(holder_path.exists, first, 120, "the first run's lock")
    assert not rec_path.exists() or rec_path.stat().st_size == 0
    seconds = _refused(_cmd(out, 1), first.pid, out)
    assert seconds <= REFUSAL_S, f"refused after {seconds:.1f} s"
    assert first.wait(timeout=900) == 0, first.stderr.read()
    keys = _keys(out)
    assert len(keys) == CELLS and set(keys.values()) == {1}
    assert not (out / LOCK_NAME).exists() and not holder_path.exists()   # released at the end

    # 2. two --resume runs adding problems: the second is refused and changes nothing (the first is stopped
    # meanwhile, so the records cannot move under the comparison)
    resume = _cmd(out, 3, "--resume")
    holder = _start(resume)
    wait_for(lambda: (read_holder(out) or {}).get("pid") == holder.pid, holder, 120, "the resumed run's lock")
    holder.send_signal(signal.SIGSTOP)
    try:
        before = rec_path.read_bytes()
        _refused(resume, holder.pid, out)
        assert rec_path.read_bytes() == before
    finally:
        holder.send_signal(signal.SIGCONT)

    # 3. the holder killed with SIGKILL mid-run: its lock dies with it, and --resume finishes the cells
    wait_for(lambda: rec_path.read_text().count("\n") > CELLS, holder, 900, "a resumed record")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_holder(out)["pid"] == holder.pid   # the stale holder file stays; its lock does not
    r = subprocess.run(resume, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stderr
    keys = _keys(out)
    assert len(keys) == 3 * CELLS and set(keys.values()) == {1}
    assert not (out / LOCK_NAME).exists() and not holder_path.exists()
