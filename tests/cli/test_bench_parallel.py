"""``zoomr bench -np N``: cells decoded together in one batched forward give the records ``-np 1`` gives
(greedy fp32), resume in any finishing order, and bad values of -np are one line and exit 2."""

import json
import os
import random
import shutil
import subprocess

import pytest

from conftest import ROOT, zoomr_cmd
from zoomr.evaluation.datasets import load_problems
from zoomr.evaluation.records import record_differences

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
# the two tests on the ``runs`` fixture share one xdist worker: apart (pytest -n with --dist loadgroup), each
# worker ran both benches of the module fixture, ~40 s more on a 2-core host
SHARES_RUNS = pytest.mark.xdist_group("bench_parallel_runs")


def _problems_file(tmp_path) -> str:
    """Four real GSM8K problems of different lengths, the longest of the first 40: each prompt is longer than
    B=16, so SnapKV compresses it at prefill and its fidelity differs from full KV's. (R-KV, as its reference
    runs, compresses only on the decode step that writes a multiple of 128: within 24 tokens it fires on
    at most the prompts just below one.)"""
    _, problems = load_problems("gsm8k", 40)
    chosen = sorted(problems, key=lambda p: len(p.question))[-4:]
    path = tmp_path / "long_gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": p.question, "answer": f"#### {p.gold}"}) + "\n" for p in chosen))
    return str(path)


def _bench(data, out, *extra):
    cmd = zoomr_cmd() + ["bench", "--dataset", data, "-n", "24", "--budget", "16", "--policies", "full,snapkv",
                         "--dtype", "fp32", "--no-live", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _keyed(out) -> dict:
    return {(r["problem_id"], r["policy"], r["budget"]): r for r in _records(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("np")
    data = _problems_file(tmp)
    out = {}
    for n in (1, 3):
        out[n] = tmp / f"np{n}"
        r = _bench(data, out[n], "-np", str(n))
        assert r.returncode == 0, r.stderr
    return data, out


@pytest.mark.slow
@SHARES_RUNS
def test_parallel_records_equal_sequential(runs):
    _, out = runs
    one = _keyed(out[1])
    assert len(one) == 8
    # field by field, timings aside; the KL within 1e-4 relative: a float64 sum over logits whose last bits
    # depend on the batch's matmul shapes (batched logits agree to 1e-4, tests/backends/test_batch.py)
    assert record_differences(_records(out[1]), _records(out[3])) == []
    # the comparison means something: SnapKV evicted (its distribution left full KV's) on most problems
    snap = [r for k, r in one.items() if k[1] == "snapkv"]
    assert sum(r["fidelity_kl"] > 1e-3 for r in snap) >= 3 and all(r["fidelity_tokens"] == 24 for r in snap)
    # prompts of four lengths: ragged prefill, and the batch changed as cells finished and joined
    assert len({r["prompt_tokens"] for r in one.values()}) == 4
    order = [(r["problem_id"], r["policy"]) for r in map(json.loads, (out[3] / "records.jsonl").read_text().splitlines())]
    assert order != sorted(order, key=lambda c: (c[0], c[1] != "full"))  # -np 3 finished out of problem order


@pytest.mark.slow
@SHARES_RUNS
def test_resume_after_parallel_run_in_any_order(runs, tmp_path):
    data, out = runs
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(out[3] / "config.json", part / "config.json")
    lines = (out[3] / "records.jsonl").read_text().splitlines()
    # a crash leaves some cells, in the order they finished: here problem 1's full KV and three others,
    # shuffled; problem 1's snapkv cell is missing, so its full-KV reference runs again, unrecorded
    recs = [json.loads(l) for l in lines]
    p1 = sorted({r["problem_id"] for r in recs})[1]
    others = [l for l, r in zip(lines, recs) if r["problem_id"] != p1]
    random.Random(0).shuffle(others)
    kept = [l for l, r in zip(lines, recs) if r["problem_id"] == p1 and r["policy"] == "full"] + others[:3]
    random.Random(1).shuffle(kept)
    (part / "records.jsonl").write_text("".join(l + "\n" for l in kept))
    r = _bench(data, part, "-np", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert record_differences(_records(out[1]), _records(part)) == []
    resumed = _keyed(part)
    for l in kept:  # the records there before stay as they were
        rec = json.loads(l)
        assert resumed[(rec["problem_id"], rec["policy"], rec["budget"])] == rec


@pytest.mark.parametrize("value,flags", [("0", ["-np", "0"]), ("-1", ["-np", "-1"]), ("-7", ["-np", "-7"]),
                                         ("0", ["-np0"])])   # glued, as -np0: still -np's own check, not -n's
@pytest.mark.slow
def test_parallel_below_one_refused(tmp_path, value, flags):
    r = subprocess.run(zoomr_cmd() + ["bench", "--limit", "1", *flags, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"zoomr: error: -np must be >= 1 parallel sequence, got {value}"
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_parallel_beyond_memory_refused_before_any_cell(tmp_path):
    # each sequence may hold -c positions of its own K/V and full KV's reference logits: 10^5 of them at
    # -c 8192 need ~80 TiB, more than any machine has free
    out = tmp_path / "o"
    r = subprocess.run(zoomr_cmd() + ["bench", "--limit", "1", "-np", "100000", "-n", "4096", "-c", "8192",
                                      "--out", str(out)], capture_output=True, text=True, cwd=ROOT, env=ENV,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zoomr: error: -np 100000: ") and "GiB free" in err[0], err
    assert not out.exists()  # the folder this run made is gone again: refused means nothing left behind


def test_record_differences_names_what_differs():
    rec = {"problem_id": "0", "policy": "rkv", "budget": 16, "correct": False, "mean_active_tokens": 40.5,
           "tokens_generated": 24, "text": "x", "fidelity_kl": 0.5, "wall_s": 1.0}
    same = {**rec, "wall_s": 9.0, "fidelity_kl": 0.5 * (1 + 1e-5)}  # timings and KL rounding aside
    assert record_differences([rec], [same]) == []
    assert record_differences([rec], [{**rec, "text": "y"}]) == ["('0', 'rkv', 16) text: 'x' vs 'y'"]
    assert record_differences([rec], [{**rec, "fidelity_kl": 0.51}])
    assert record_differences([rec], [{**rec, "budget": 32}]) == ["('0', 'rkv', 16): only in the first",
                                                                  "('0', 'rkv', 32): only in the second"]
    assert record_differences([rec, rec], [rec]) == ["a cell is recorded twice"]
