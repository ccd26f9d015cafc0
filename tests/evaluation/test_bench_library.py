"""``zoomr.bench`` from Python: the CLI's engine behind a library call that prints nothing, reports records and
events as they happen, refuses bad options the way ``zoomr.load`` does, and builds each cell's policy once."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

import zoomr
from conftest import ROOT, zoomr_cmd
from zoomr.errors import UserError
from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.datasets import load_problems
from zoomr.evaluation.records import record_differences, write_config
from zoomr.evaluation.bench_plan import plan_bench
from zoomr.evaluation.runner import bench_options
from zoomr.kvstore.registry import PolicySpec

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
SETTINGS = {"policies": ["full", "rkv"], "budgets": [16], "limit": 1, "n_predict": 24, "dtype": "fp32"}


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_library_bench_equals_the_cli_and_builds_each_cell_once(tmp_path, monkeypatch, capfd):
    builds = Counter()
    real = PolicySpec.build

    def counting(self):
        # a build by the cache factory's __call__ is a sequence's own fresh policy; any other is a cell's check
        if sys._getframe(1).f_code.co_name != "__call__":
            builds[(self.name, self.knobs.get("budget"))] += 1
        return real(self)

    monkeypatch.setattr(PolicySpec, "build", counting)
    seen, events = [], []
    out = tmp_path / "lib"
    result = zoomr.bench(**SETTINGS, out=out, on_record=seen.append, on_event=events.append)
    assert capfd.readouterr() == ("", "")   # the library prints nothing: the CLI draws the events
    lib = _records(out)
    assert len(lib) == 2 and seen == lib == result["records"]
    assert [e.record for e in events if isinstance(e, ev.CellFinished)] == lib
    assert [(r["policy"], r["budget"]) for r in result["rows"]] == [("full", None), ("rkv", 16)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {"config": result["config"], "rows": result["rows"]} and result["out"] == out
    kinds = [type(e) for e in events]
    assert kinds[:3] == [ev.Loading, ev.Loading, ev.BenchStarted] and kinds[-2:] == [ev.SummaryWritten,
                                                                                    ev.BenchFinished]
    assert events[:2] == [ev.Loading("model"), ev.Loading("model", ended=True)]
    started = events[2]
    assert started.model and (started.total, started.done, started.problems) == (2, 0, 1)
    # checked builds: full's once for its cell and once for the model load; rkv B=16 once for the whole bench
    # (before: twice to validate and twice more per problem before its first token)
    assert builds == {("full", None): 2, ("rkv", 16): 1}

    cli = tmp_path / "cli"
    r = subprocess.run(zoomr_cmd() + ["bench", "--dataset", "gsm8k", "--limit", "1", "-n", "24", "--budget", "16",
                                      "--policies", "full,rkv", "--dtype", "fp32", "--no-live", "--out", str(cli)],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert record_differences(lib, _records(cli)) == []   # field by field, timings aside
    cli_config = json.loads((cli / "config.json").read_text())
    lib_config = json.loads((out / "config.json").read_text())
    assert {**cli_config, "provenance": None} == {**lib_config, "provenance": None}


def test_a_finished_bench_is_summarized_without_loading_a_model(tmp_path):
    _, (problem,) = load_problems("gsm8k", 1)
    out = tmp_path / "b"
    plan = plan_bench(bench_options(None, {}), ["full"], None, dataset="gsm8k", limit=1, out=out,
                      match_budget=False, fidelity=True, n_parallel=1, rescue=None)
    out.mkdir()
    write_config(out / "config.json", plan.config)
    rec = {"problem_id": problem.id, "policy": "full", "budget": None, "budget_tokens": None, "gold": problem.gold,
           "correct": True, "mean_active_tokens": 9, "peak_active_tokens": 9, "tokens_generated": 4}
    (out / "records.jsonl").write_text(json.dumps(rec) + "\n")
    events = []
    result = zoomr.bench(policies="full", limit=1, out=out, resume=True, on_event=events.append,
                         on_record=lambda r: pytest.fail("no cell runs"))
    assert [type(e) for e in events] == [ev.BenchStarted, ev.SummaryWritten, ev.BenchFinished]
    started, _, finished = events
    assert started.model is None and (started.total, started.done) == (1, 1)
    assert finished.summary == out / "summary.json" and len(finished.plots) == 3
    assert result["records"] == [rec] and result["warnings"] == []
    assert json.loads((out / "summary.json").read_text())["rows"] == result["rows"]


@pytest.mark.parametrize("kwargs,error,needle", [
    ({"bogus": 1}, TypeError, "unknown option(s) bogus"),
    ({"budget": 16}, TypeError, "budgets=[...]"),
    ({"policies": ["full", "nope"]}, UserError, "--policies: unknown nope"),
    ({"policies": []}, UserError, "give at least one"),
    ({"policies": "full,rkv,full"}, UserError, "full given more than once"),
    ({"policies": ["full"], "budgets": [0, 16]}, UserError, "at least 1 token"),
    ({"policies": ["full"], "sink": 2}, UserError, "--sink is read by streaming only"),
    ({"policies": ["full", "rkv"], "match_budget": True}, UserError, "needs zoomr among --policies"),
    ({"backend": "llamacpp"}, UserError, "torch backend"),
    ({"n_parallel": 0}, UserError, "-np must be >= 1"),
])
def test_bad_library_options_are_refused_before_anything_is_made(tmp_path, kwargs, error, needle):
    out = tmp_path / "o"
    with pytest.raises(error) as e:
        zoomr.bench(limit=1, out=out, **kwargs)
    assert needle in str(e.value)
    assert not out.exists()
