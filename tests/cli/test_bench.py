"""``zoomr bench`` on the embedded model: all files, resumable after SIGKILL, metrics that mean something."""

import json
import os
import signal
import subprocess
from collections import Counter

import numpy as np
import pytest

from conftest import ROOT, sigint_default, wait_for, zoomr_cmd
from zoomr.evaluation.bench_plan import plan_cells
from zoomr.evaluation.records import RecordLog
from zoomr.evaluation.metrics import FidelityMeter, recovered_fraction
from zoomr.evaluation.rescue_cells import rescue_rows

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
ARGS = ["bench", "--dataset", "gsm8k", "-n", "8", "--budget", "16", "--no-live"]
POLICIES = "full,streaming,rkv,zoomr"  # one of each kind: reference, budgeted, score-based, segmented


@pytest.mark.slow
def test_three_problem_bench_writes_everything(tmp_path):
    out = tmp_path / "b"
    r = subprocess.run(zoomr_cmd() + ARGS + ["--limit", "3", "--policies", POLICIES, "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stderr
    for f in ("records.jsonl", "summary.json", "config.json", "accuracy_vs_kv.png", "fidelity_vs_kv.png",
              "active_kv_vs_generated.png"):
        assert (out / f).stat().st_size > 0, f
    recs = [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 3 * len(plan_cells(POLICIES.split(","), [16]))
    rows = {(r["policy"], r["budget"]): r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows[("full", None)]["saving"] == 1.0
    # streaming with B=16 really holds less than full and so can disagree with it
    assert rows[("streaming", 16)]["mean_active_tokens"] < rows[("full", None)]["mean_active_tokens"]
    assert 0 <= rows[("streaming", 16)]["fidelity_top1"] <= 1
    for rec in recs:
        assert rec["tokens_generated"] <= 8 and isinstance(rec["correct"], bool)
        assert rec["saving"] == pytest.approx(rec["mean_full_bytes"] / (rec["mean_active_bytes"]
                                                                        + rec["mean_policy_state_bytes"]), rel=1e-2)
        assert rec["mean_active_tokens"] <= rec["peak_active_tokens"] and rec["n_boxed_distinct"] >= 0
    prov = json.loads((out / "config.json").read_text())["provenance"]
    assert len(prov["model_sha256"]) == 64 and prov["packages"]["torch"]
    # the model line as the run printed it: what --quant/--dtype auto resolved to here
    assert prov["model_line"].startswith("smollm2-135m · ") and prov["model_line"] in r.stdout + r.stderr


@pytest.mark.slow
def test_resume_after_sigkill_records_each_cell_once(tmp_path):
    out = tmp_path / "b"
    # 2 problems x 3 cells; the kill usually lands inside problem 0, so the resume reruns its full-KV reference
    cmd = zoomr_cmd() + ARGS + ["--limit", "2", "--policies", "full,streaming,zoomr", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    rec_path = out / "records.jsonl"
    wait_for(lambda: lines_in(rec_path) >= 2, p, 600, "two records")
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = rec_path.read_text().count("\n")
    assert 2 <= before < 6
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stderr
    keys = Counter((j["problem_id"], j["policy"], j["budget"])
                   for j in map(json.loads, rec_path.read_text().splitlines()))
    assert len(keys) == 6 and set(keys.values()) == {1}
    # without --resume the same folder is refused rather than silently duplicated
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert r.returncode == 2 and "--resume" in r.stderr


@pytest.mark.slow
def test_ctrl_c_keeps_finished_cells_and_says_so(tmp_path):
    out = tmp_path / "c"
    cmd = zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", "2", "-n", "8", "--budget", "16", "--no-live",
                         "--policies", "full,streaming", "--out", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                         preexec_fn=sigint_default)
    rec_path = out / "records.jsonl"
    wait_for(lambda: lines_in(rec_path) >= 1, p, 600, "a first record")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "zoomr: interrupted", err
    kept = rec_path.read_text().count("\n")
    assert 1 <= kept < 4 and "Traceback" not in err
    assert len(json.loads((out / "summary.json").read_text())["rows"]) >= 1  # written on the way out
    assert "with --resume runs the rest" in err.strip().splitlines()[-2]


def lines_in(path) -> int:
    """Complete lines in a file that may not exist yet."""
    return path.read_text().count("\n") if path.exists() else 0


def test_torn_last_line_is_dropped(tmp_path):
    p = tmp_path / "records.jsonl"
    fields = '"correct": false, "mean_active_tokens": 9, "tokens_generated": 4'
    p.write_text('{"problem_id": "0", "policy": "full", "budget": null, %s}\n{"problem_id": "1", "pol' % fields)
    log = RecordLog(p)
    assert len(log.records) == 1 and p.read_text().endswith("}\n")


def test_a_ctrl_c_right_after_a_records_fsync_still_reaches_the_summary(tmp_path, monkeypatch):
    """The race the subprocess test above can hit: SIGINT lands while ``append`` is in ``os.fsync``, so the
    KeyboardInterrupt fires after the line is durable but before it is in ``log.records``."""
    import zoomr.evaluation.records as records
    from zoomr.evaluation.bench_finish import finish

    out = tmp_path / "o"
    out.mkdir()
    log = RecordLog(out / "records.jsonl")
    real = os.fsync

    def fsync_then_interrupt(fd):
        real(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(records.os, "fsync", fsync_then_interrupt)
    rec = {"problem_id": "0", "policy": "full", "budget": None, "budget_tokens": None, "gold": "3",
           "correct": True, "mean_active_tokens": 9, "peak_active_tokens": 9, "tokens_generated": 4}
    with pytest.raises(KeyboardInterrupt):
        log.append(rec)
    monkeypatch.setattr(records.os, "fsync", real)
    assert log.records == []  # the in-memory list missed it; the file has it
    finish(out, {"model": "m.gguf", "dataset": "gsm8k", "n_predict": 8}, log, lambda event: None, [])
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [(r["policy"], r["budget"]) for r in rows] == [("full", None)]


def test_fidelity_meter_and_recovered_fraction():
    m = FidelityMeter()
    a = np.array([2.0, 0.0, -1.0])
    m.add(a, a)
    m.add(a, np.array([0.0, 2.0, -1.0]))
    res = m.result()
    assert res["fidelity_top1"] == 0.5 and res["fidelity_kl"] > 0
    assert recovered_fraction(0.8, 0.5, 0.9) == (0.8 - 0.5) / (0.9 - 0.5)
    assert recovered_fraction(0.5, 0.5, 0.5) is None


def _records(out):
    return [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rescue_cells_added_to_a_finished_bench_by_resume(tmp_path):
    out = tmp_path / "b"
    small = ["bench", "--dataset", "gsm8k", "--limit", "2", "-n", "12", "--no-live", "--policies", "full",
             "--out", str(out)]
    r = subprocess.run(zoomr_cmd() + small, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1200)
    assert r.returncode == 0, r.stderr
    # a detector that aborts every base candidate at its first token: rescue must abort, best-of-N never does
    rescue = ["--rescue", "--budget", "16", "--nb", "1", "--nh", "1", "--step-tokens", "6", "--abort-entropy", "0",
              "--entropy-guard", "0", "--resume"]
    r = subprocess.run(zoomr_cmd() + small + rescue, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stderr
    recs = _records(out)
    keys = Counter((j["problem_id"], j["policy"], j["budget"]) for j in recs)
    # full kept; the sampled full-KV reference, best-of-n and rescue added
    assert set(keys.values()) == {1} and len(keys) == 2 * 4
    for rec in recs:
        if rec["policy"] in ("best-of-n", "full-best-of-n"):  # eviction-only: the helper never proposes a step
            assert rec["candidates"]["helper"] == 0 and rec["helper_share"] == 0 and rec["base_tokens"] > 0
            assert rec["aborted"] == 0 and rec["early_exit"] is False  # the paper's baseline: no early exit
        if rec["policy"] == "full-best-of-n":   # the same best-of-N on full KV, once per problem
            assert rec["budget"] is None and rec["mean_active_bytes"] == rec["mean_full_bytes"]
        if rec["policy"] == "rescue":
            assert rec["candidates"]["helper"] == rec["steps"] and rec["candidates"]["base"] == rec["steps"]
            assert 0 <= rec["helper_share"] <= 1 and rec["tokens_generated"] <= 12
            assert rec["aborted"] == rec["candidates"]["base"] > 0
            # the helper's KV is part of the method's memory
            assert rec["method_kv_bytes_mean"] >= rec["mean_active_bytes"] + rec["helper_kv_bytes_mean"]
            assert rec["helper_kv_bytes_mean"] > 0
        if rec["policy"] in ("rescue", "best-of-n", "full-best-of-n"):
            assert rec["scorer"].startswith("likelihood:") and rec["helper_is_base"] is True
            assert rec["detector"] == "zoomr"
    assert "proves little" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rescue"]["nb"] == 1 and summary["config"]["n_predict"] == 12
    (row,) = summary["rescue"]
    bon = [r["base_tokens"] for r in recs if r["policy"] == "best-of-n"]
    res = [r["base_tokens"] for r in recs if r["policy"] == "rescue"]
    assert row["budget"] == 16 and abs(row["base_token_ratio"] - sum(res) / sum(bon)) < 1e-9
    # the recovered fraction's A_full is the sampled full-KV cell's, not the greedy full cell's
    acc = {p: sum(r["correct"] for r in recs if r["policy"] == p) / 2 for p in ("full", "full-best-of-n")}
    assert row["full_reference"] == "sampled" and row["acc_full"] == acc["full-best-of-n"]
    assert row["acc_full_greedy"] == acc["full"] and row["scorer"] == "likelihood scorer, no PRM"
    # resuming a finished bench redraws table and files from the records without loading any model
    (out / "summary.json").unlink()
    r = subprocess.run(zoomr_cmd() + small + rescue, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 0 and "loading" not in r.stderr and "already in" in r.stderr, r.stderr
    assert json.loads((out / "summary.json").read_text())["rescue"] == summary["rescue"]
    assert len(_records(out)) == len(recs)
    # changing a rescue setting on resume is refused, not mixed into the same records
    r = subprocess.run(zoomr_cmd() + small + rescue[:-1] + ["--nh", "2", "--resume"], capture_output=True,
                       text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 2 and "rescue" in r.stderr


@pytest.mark.slow
def test_match_budget_gives_baselines_zoomrs_measured_kv(tmp_path):
    out = tmp_path / "m"
    # --window 8 and 16-token segments make zoomr evict within 96 tokens; the window also fixes streaming's recent window, so no budget can
    # give streaming zoomr's memory: that row must be flagged, not passed off as matched
    r = subprocess.run(zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", "1", "-n", "96", "--ignore-eos",
                                      "--no-live", "--no-fidelity", "--policies", "streaming,h2o,rkv,zoomr",
                                      "--match-budget", "--window", "8", "--topk-per-head", "1", "--consensus", "1",
                                      "--segment-tokens", "16", "--out", str(out)], capture_output=True, text=True,
                                      cwd=ROOT, env=ENV,
                       timeout=1200)
    assert r.returncode == 0, r.stderr
    by = {rec["policy"]: rec for rec in _records(out)}
    assert set(by) == {"full", "zoomr", "streaming", "h2o", "rkv"}
    target = by["zoomr"]["mean_active_tokens"]
    assert target < 0.95 * by["full"]["mean_active_tokens"]  # zoomr really evicts
    for name in ("h2o", "rkv", "streaming"):
        rec = by[name]
        assert rec["budget"] == "matched" and isinstance(rec["budget_tokens"], int)
        assert rec["target_active_tokens"] == pytest.approx(target, abs=0.01)
        assert rec["peak_active_tokens"] <= max(rec["bound_tokens"], rec["prompt_tokens"])
    for name in ("h2o", "rkv"):  # matched on what is measured: within ±10 % of zoomr's time-averaged KV
        assert abs(by[name]["mean_active_tokens"] / target - 1) <= 0.10 and by[name]["matched_within"], by[name]
    assert by["streaming"]["matched_within"] is False and by["streaming"]["match_error"] < -0.10
    assert "off by more than 10% for streaming" in r.stderr
    rows = {row["policy"]: row for row in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["streaming"]["matched_within"] is False and rows["rkv"]["matched_within"] is True


def test_rescue_rows_recovered_fraction_and_base_token_ratio():
    # rows as bench_metrics.summarize gives them (means over problems; rescue fields on rescue cells only)
    def row(policy, budget, accuracy, no_answer, **kw):
        return {"policy": policy, "budget": budget, "accuracy": accuracy, "no_answer_at_cap_rate": no_answer,
                "helper_share": None, "base_tokens": None, **kw}

    # the greedy full cell (1.0) is the fidelity reference; the fraction's A_full is the sampled full-KV
    # best-of-N (0.75), same sampling and seeds as rescue and best-of-N
    rows = [row("full", None, 1.0, 0.0), row("rkv", 64, 0.25, 0.5),
            row("full-best-of-n", None, 0.75, 0.0, base_tokens=300, helper_share=0.0),
            row("best-of-n", 64, 0.0, 1.0, base_tokens=400, helper_share=0.0, method_kv_bytes_mean=3000),
            row("rescue", 64, 0.5, 0.5, base_tokens=200, helper_share=0.375, method_kv_bytes_mean=5000,
                scorer="likelihood:/m/smollm2.gguf"),
            row("rescue", 128, 0.75, 0.0, base_tokens=100, helper_share=0.25)]   # its best-of-n has not run yet
    r64, r128 = rescue_rows(rows)
    assert r64["acc_full"] == 0.75 and r64["acc_best_of_n"] == 0.0 and r64["acc_rescue"] == 0.5
    assert (r64["full_reference"], r64["full_reference_cell"], r64["acc_full_greedy"]) == ("sampled", "full-best-of-n", 1.0)
    assert r64["recovered_fraction"] == 0.5 / 0.75 and r64["helper_share"] == 0.375
    assert r64["scorer"] == "likelihood scorer, no PRM" and r128["scorer"] is None
    # without the sampled reference (a bench still running) there is no fraction: the greedy one is never used
    (no_ref,) = rescue_rows([r for r in rows if r["policy"] != "full-best-of-n" and r["budget"] != 128])
    assert no_ref["acc_full"] is None and no_ref["acc_full_greedy"] == 1.0 and no_ref["recovered_fraction"] is None
    assert r64["base_token_ratio"] == 200 / 400 and r64["no_answer_at_cap_best_of_n"] == 1.0
    assert r64["no_answer_at_cap_rescue"] == 0.5
    assert (r64["method_kv_bytes_mean_rescue"], r64["method_kv_bytes_mean_best_of_n"]) == (5000, 3000)
    assert r128["budget"] == 128 and r128["acc_best_of_n"] is None and r128["recovered_fraction"] is None
    assert r128["base_token_ratio"] is None and r128["method_kv_bytes_mean_rescue"] is None


@pytest.mark.parametrize("case,args,needle", [
    ("array", ["--dataset", "{d}"], "JSON object"),
    ("not_json", ["--dataset", "{d}"], ":1: not JSON (Expecting"),
    ("null_answer", ["--dataset", "{d}"], "answer"),
    ("empty_problem", ["--dataset", "{d}"], "empty"),
    (None, ["-n", "0"], "-n 0"),
    (None, ["-n", "-5"], "-n -5"),
    (None, ["--policies", ","], "at least one"),
    (None, ["--policies", "full,,rkv"], "an empty name between commas"),
    (None, ["--policies", "full,rkv,full"], "full given more than once"),
    (None, ["--backend", "llamacpp"], "torch"),
    (None, ["--rescue", "--base-policy", "full"], "must evict"),
    (None, ["--base-policy", "rkv"], "--base-policy needs --rescue"),
    (None, ["--policies", "full,streaming,rkv", "--budget", "32", "--window", "32"], "cell streaming B=32"),
    (None, ["--policies", "full,rkv", "--sink", "2"], "--sink is read by streaming only"),
    (None, ["--policies", "sumr", "--summaries", "bogus"], "cell sumr: --summaries"),
    (None, ["--policies", "full", "--budget", "32"], "--budget is read by"),
    (None, ["--policies", "full,rkv,zoomr", "--match-budget", "--budget", "32"], "drop --budget"),
    (None, ["-t", "-1"], "-t must be >= 1"),
    (None, ["-t", "100000"], "-t 100000: at most 1024 threads"),   # was a segfault, exit 139, no message
    # checked as solve checks its prompt, before the folder takes the run's settings
    ("tiny_ctx", ["--out", "{o}", "-c", "24", "--policies", "full"], "problem 0: the prompt has"),
    ("config_list", ["--out", "{o}", "--resume"], "not a bench config"),
    ("records_no_config", ["--out", "{o}", "--resume"], "no config.json"),
    ("out_is_file", ["--out", "{d}"], "is a file, not a folder"),
    ("bad_record", ["--out", "{o}", "--resume"], "not a bench record"),
    ("binary_record", ["--out", "{o}", "--resume"], "not a bench record"),
    ("bad_config", ["--out", "{o}", "--resume"], "not a bench config"),
])
@pytest.mark.slow
def test_bench_bad_input_is_one_line_exit_2(tmp_path, case, args, needle):
    d, o = tmp_path / "data.jsonl", tmp_path / "out"
    o.mkdir()
    lines = {"array": "[1, 2]", "not_json": '{"question": "1+1?", answer: 2}',
             "null_answer": '{"question": "1+1?", "answer": null}',
             "empty_problem": '{"problem": "  ", "answer": "2"}'}
    d.write_text(lines.get(case, '{"question": "1+1?", "answer": "2"}') + "\n")
    if case == "bad_record":
        (o / "records.jsonl").write_text("{}\n")
    elif case == "binary_record":
        (o / "records.jsonl").write_bytes(b"\xfe\xff\x00garbage\n")
    elif case == "bad_config":
        (o / "config.json").write_text("{nope")
    elif case == "config_list":
        (o / "config.json").write_text("[]")
    elif case == "records_no_config":
        (o / "records.jsonl").write_text('{"problem_id": "0", "policy": "full", "budget": null, "correct": false, '
                                         '"mean_active_tokens": 9, "tokens_generated": 4}\n')
    cmd = ["bench", "--limit", "1", "-n", "4", "--no-live", *[a.format(d=d, o=o) for a in args]]
    r = subprocess.run(zoomr_cmd() + cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("zoomr: error:") and needle.lower() in lines[-1].lower(), r.stderr
    assert "Traceback" not in r.stderr
    # a refused run leaves no settings behind
    assert not (o / "config.json").exists() or case in ("bad_config", "config_list")


@pytest.mark.slow
def test_resume_into_a_folder_without_records_says_it_starts_anew(tmp_path):
    out = tmp_path / "typo"
    r = subprocess.run(zoomr_cmd() + ["bench", "--dataset", "gsm8k", "-n", "2", "--limit", "1", "--policies", "full",
                                      "--no-live", "--resume", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"warning: --resume: {out} holds no bench records yet; starting a new run there" in r.stderr
    assert len((out / "records.jsonl").read_text().splitlines()) == 1
