"""``zoomr bench --rescue`` (issue 47): the recovered fraction's full-KV reference is sampled like the rescue and
best-of-N cells; rescue rows say their scorer in the tables and plots; ZoomR's AG column is the paper's."""

import json
import os
import subprocess

import pytest
from rich.console import Console

from conftest import ENV, ROOT, zoomr_cmd
from zoomr.cli.bench_tables import main_table, memory_table, rescue_table
from zoomr.evaluation import plots
from zoomr.evaluation.metrics import summarize
from zoomr.evaluation.rescue_cells import cell_label, rescue_rows, scorer_note

LIKELIHOOD = "likelihood:/models/smollm2.gguf"


def _render(table) -> str:
    console = Console(width=400, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


def _record(policy, budget, correct, **kw):
    return {"problem_id": "p", "policy": policy, "budget": budget, "correct": correct, "tokens_generated": 9,
            "mean_active_tokens": 50.0, "no_answer_at_cap": False, **kw}


def test_scorer_notes_and_labels():
    assert scorer_note(LIKELIHOOD) == "likelihood scorer, no PRM"
    assert scorer_note("prm:/models/Qwen2.5-Math-PRM-7B") == "PRM Qwen2.5-Math-PRM-7B"
    assert cell_label("rescue", LIKELIHOOD) == "rescue (likelihood scorer, no PRM)"
    assert cell_label("full-best-of-n", "prm:/m/prm") == "full-best-of-n (PRM prm)"
    assert cell_label("rkv", LIKELIHOOD) == "rkv" and cell_label("rescue") == "rescue"


def test_tables_and_plots_name_the_scorer_and_show_the_papers_ag():
    records = [_record("full", None, True), _record("zoomr", None, True, kv_extra={"ag_mean": 0.625, "ag_std": 0.1,
                                                                                    "ag_candidates_mean": 0.5}),
               _record("full-best-of-n", None, True, scorer=LIKELIHOOD, base_tokens=30, helper_share=0.0),
               _record("best-of-n", 16, False, scorer=LIKELIHOOD, base_tokens=40, helper_share=0.0),
               _record("rescue", 16, True, scorer=LIKELIHOOD, base_tokens=20, helper_share=0.5)]
    rows = summarize(records)
    by = {r["policy"]: r for r in rows}
    assert by["zoomr"]["ag_mean"] == 0.625 and by["zoomr"]["ag_candidates_mean"] == 0.5
    assert by["full"]["ag_mean"] is None
    assert by["rescue"]["scorer"] == LIKELIHOOD and by["full"]["scorer"] is None
    main, memory = _render(main_table(rows)), _render(memory_table(rows))
    for text in (main, memory):
        # each rescue cell's row says its scorer, on the line under the cell's name (the column stays narrow)
        lines = [line.strip() for line in text.splitlines()]
        for cell in ("rescue", "best-of-n", "full-best-of-n"):
            at = next(i for i, line in enumerate(lines) if line.split(" ")[0] == cell)
            assert lines[at + 1] == "(likelihood scorer, no PRM)", text
        assert sum(line == "(likelihood scorer, no PRM)" for line in lines) == 3
    assert " AG " in main and "0.625" in main
    (row,) = rescue_rows(rows)
    assert row["full_reference"] == "sampled" and row["acc_full"] == 1.0 and row["recovered_fraction"] == 1.0
    rescue = _render(rescue_table([row]))
    assert "scorer: likelihood scorer, no PRM" in rescue and "A greedy" in rescue
    # the plots' legends: the accuracy figure's series and the active-KV figure's curves
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plots._series(ax, rows, {}, "accuracy")
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert "rescue (likelihood scorer, no PRM)" in labels and "zoomr" in labels


@pytest.mark.slow
def test_a_rescue_bench_takes_its_recovered_fraction_from_a_sampled_full_kv_reference(tmp_path):
    """One GSM8K problem, 8 new tokens, the paper's detector: the full-KV best-of-N cell samples as best-of-N does
    (same seeds, candidates and scorer); at 8 tokens R-KV never compresses (it waits for 128 decoded), so the
    evicted best-of-N and the full-KV one see the same KV and commit the same text."""
    out = tmp_path / "b"
    r = subprocess.run(zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", "1", "-n", "8", "--no-live",
                                      "--policies", "full", "--out", str(out), "-t", "1", "--rescue",
                                      "--budget", "16", "--nb", "2", "--nh", "1", "--step-tokens", "4",
                                      "--detector", "paper"],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1800)
    assert r.returncode == 0, r.stderr
    recs = {(j["policy"], j["budget"]): j for j in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    assert set(recs) == {("full", None), ("full-best-of-n", None), ("best-of-n", 16), ("rescue", 16)}
    ref, bon, res = recs[("full-best-of-n", None)], recs[("best-of-n", 16)], recs[("rescue", 16)]
    for rec in (ref, bon, res):
        assert rec["detector"] == "paper" and rec["scorer"].startswith("likelihood:")
    # the reference is best-of-N on full KV: N_b base candidates a step, no helper candidate, no early exit
    assert ref["early_exit"] is False and ref["candidates"] == {"base": 2 * ref["steps"], "helper": 0}
    assert ref["mean_active_bytes"] == ref["mean_full_bytes"]
    assert bon["mean_active_tokens"] == ref["mean_active_tokens"] and bon["text"] == ref["text"]
    assert res["early_exit"] is True and res["candidates"]["helper"] == res["steps"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rescue"]["detector"]["name"] == "paper"
    (row,) = summary["rescue"]
    assert row["full_reference"] == "sampled" and row["full_reference_cell"] == "full-best-of-n"
    assert row["acc_full"] == float(ref["correct"]) and row["acc_full_greedy"] == float(recs[("full", None)]["correct"])
    a_res, a_bon, a_full = float(res["correct"]), float(bon["correct"]), float(ref["correct"])
    expected = None if a_full == a_bon else (a_res - a_bon) / (a_full - a_bon)
    assert row["recovered_fraction"] == expected and row["scorer"] == "likelihood scorer, no PRM"
