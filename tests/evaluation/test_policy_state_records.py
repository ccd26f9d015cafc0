"""Policy state in the records: ``zoomr solve --json``'s ``kv``, bench records, summary rows and tables; and
matched rescue cells whose base really attends ZoomR's mean active KV."""

import json
import os
import subprocess
from dataclasses import replace

import pytest
from rich.console import Console

from conftest import ROOT, zoomr_cmd
from zoomr.cli.bench_tables import match_table, memory_table
from zoomr.evaluation.batching import run_cell
from zoomr.evaluation.cells import problem_prompt
from zoomr.evaluation.datasets import Problem, load_problems
from zoomr.evaluation.match import TOLERANCE, simulated_mean_active
from zoomr.evaluation.rescue_cells import BEST_OF_N, RESCUE, RescueCells
from zoomr.evaluation.rescue_cells import plan as plan_rescue
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.records import record_problem
from zoomr.factory import policy_spec, with_policy
from zoomr.options import RunOptions
from zoomr.rescue.plan import RescueOptions

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
STATE_FIELDS = ("policy_state_bytes", "mean_policy_state_bytes", "device_kv_bytes", "saving", "saving_peak")


def _render(table) -> str:
    console = Console(width=240, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


def test_bench_record_summary_and_memory_table_carry_policy_state(torch_backend):
    """An H2O cell on the embedded model: its scores are in the record, the row and the memory table."""
    opts = RunOptions(ctx_size=torch_backend.n_ctx, device="cpu", dtype="fp32", knobs={"budget": 16})
    problem = Problem("p0", "What is 2 + 3?", "5")
    ids = problem_prompt(torch_backend.tokenizer, problem, opts.ctx_size)
    view = with_policy(torch_backend, replace(opts, policy="h2o"))
    rec = {"problem_id": problem.id, "policy": "h2o", "budget": 16,
           **run_cell(view, problem, ids, opts.sampling(default_temp=0.0), 6)}
    assert record_problem(json.dumps(rec)) is None
    assert rec["policy_state_bytes"] > 0 and rec["mean_policy_state_bytes"] > 0
    assert rec["device_kv_bytes"] >= rec["policy_state_bytes"] + rec["mean_active_bytes"]
    (row,) = summarize([rec])
    assert row["policy_state_bytes"] == rec["policy_state_bytes"]
    assert row["saving"] == pytest.approx(rec["mean_full_bytes"] / (rec["mean_active_bytes"]
                                                                    + rec["mean_policy_state_bytes"]), rel=1e-6)
    assert rec["saving"] == pytest.approx(row["saving"], abs=1e-3)
    text = _render(memory_table([row]))
    assert "state KiB" in text and f"{rec['policy_state_bytes'] / 1024:.1f}" in text


def test_matched_table_shows_mean_and_peak_side_by_side():
    rows = summarize([{"problem_id": "p", "policy": "rkv", "budget": "matched", "correct": True,
                       "tokens_generated": 9, "mean_active_tokens": 101.5, "peak_active_tokens": 140,
                       "budget_tokens": 40, "target_active_tokens": 100.0, "target_peak_active_tokens": 123,
                       "match_error": 0.015, "matched_within": True}])
    text = _render(match_table(rows))
    assert "target peak" in text and "123" in text and "140" in text and "101.5" in text


@pytest.mark.slow
def test_solve_json_kv_has_policy_state_on_both_backends():
    """torch H2O keeps scores (> 0, inside device_kv_bytes); llama.cpp's streaming keeps none (0), same fields."""
    kvs = {}
    for backend, policy in (("torch", "h2o"), ("llamacpp", "streaming")):
        r = subprocess.run(zoomr_cmd() + ["solve", "-p", "What is 2+3?", "-n", "4", "--backend", backend,
                                          "--policy", policy, "--budget", "16", "--json", "-", "--no-live"],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
        assert r.returncode == 0, r.stderr
        kvs[backend] = json.loads(r.stdout)["kv"]
        assert all(f in kvs[backend] for f in STATE_FIELDS), kvs[backend]
    assert kvs["torch"]["policy_state_bytes"] > 0 and kvs["llamacpp"]["policy_state_bytes"] == 0
    assert kvs["torch"]["device_kv_bytes"] >= kvs["torch"]["policy_state_bytes"]


@pytest.mark.slow
def test_matched_rescue_cells_attend_zoomrs_mean_active_kv(torch_backend):
    """Both rescue cells at the matched budget, after ZoomR on the same GSM8K problem (192 tokens, ~2 minutes):
    the base's B goes through predict_budget, so R-KV's buffer of 128 is accounted for; ZoomR's mean taken as
    B (the old rule) would attend about 40 positions more here and miss by > 10 %."""
    n = 192
    _, (problem,) = load_problems("gsm8k", 1)
    ids = problem_prompt(torch_backend.tokenizer, problem, torch_backend.n_ctx)
    # ZoomR evicting within the run: an 8-token window and 16-token segments
    zo = RunOptions(ctx_size=torch_backend.n_ctx, device="cpu", dtype="fp32",
                    knobs={"window": 8, "topk_per_head": 1, "consensus": 1, "segment_tokens": 16})
    zoomr = run_cell(with_policy(torch_backend, replace(zo, policy="zoomr")), problem, ids,
                     zo.sampling(default_temp=0.0), n, ignore_eos=True)
    target = zoomr["mean_active_tokens"]
    opts = RunOptions(ctx_size=torch_backend.n_ctx, device="cpu", dtype="fp32", top_k=20, knobs={"window": 8})
    spec = policy_spec(replace(opts, policy="rkv"))
    # the old rule would overshoot on this problem: the setting tells the two apart
    assert simulated_mean_active(spec.with_knobs(budget=round(target)), len(ids), n) > (1 + TOLERANCE) * target
    rplan, _ = plan_rescue(RescueOptions(rescue=True, nb=1, nh=1, step_tokens=32), opts)
    cells = RescueCells(torch_backend, opts, rplan)
    for policy in (BEST_OF_N, RESCUE):
        rec = cells.run_matched(policy, problem, ids, n, zoomr)
        assert rec["tokens_generated"] == n   # the embedded model rambles past 192 tokens: same length as ZoomR
        assert rec["budget_tokens"] < round(target) - 32
        assert abs(rec["mean_active_tokens"] / target - 1) <= TOLERANCE, (rec["mean_active_tokens"], target)
        assert rec["matched_within"] is True and rec["match_runs"] == 1 and "single try" in rec["match_kept"]
        assert rec["target_active_tokens"] == pytest.approx(target, abs=0.01)
        assert rec["target_peak_active_tokens"] == zoomr["peak_active_tokens"]
        assert rec["policy_state_bytes"] > 0   # R-KV's query window, counted in the method's KV


@pytest.mark.slow
def test_bench_match_budget_rescue_records_say_how_they_were_matched(tmp_path):
    """The bench wires the matched rescue cells through RescueCells.run_matched: records name their tries."""
    out = tmp_path / "m"
    r = subprocess.run(zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", "1", "-n", "12", "--no-live",
                                      "--no-fidelity", "--policies", "zoomr", "--match-budget", "--rescue",
                                      "--nb", "1", "--nh", "1", "--step-tokens", "6", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1200)
    assert r.returncode == 0, r.stderr
    recs = {rec["policy"]: rec for rec in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    for name in (BEST_OF_N, RESCUE):
        rec = recs[name]
        assert rec["budget"] == "matched" and rec["match_runs"] == 1 and "single try" in rec["match_kept"]
        assert rec["target_peak_active_tokens"] == recs["zoomr"]["peak_active_tokens"]
        assert isinstance(rec["budget_tokens"], int) and "policy_state_bytes" in rec
    assert all("policy_state_bytes" in rec and "mean_policy_state_bytes" in rec for rec in recs.values())
    assert sum("chosen_B=" in line for line in r.stdout.splitlines()) == 2   # the plain lines name B and the error
