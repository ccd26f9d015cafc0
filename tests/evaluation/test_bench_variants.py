"""Cells with knobs of their own (``--policies full,zoomr:window=256,snapkv``): parsed to one canonical label,
checked before any model loads, applied to that cell alone, and named in records, tables and resume keys."""

import json
import os
import subprocess

import pytest

import zoomr
from conftest import ROOT, assert_one_line_error, zoomr_cmd
from zoomr.errors import UserError
from zoomr.evaluation.bench_plan import plan_bench
from zoomr.evaluation.runner import bench_options
from zoomr.evaluation.variants import Variant, base_of, cell_knob_fields, parse_variant

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _plan(policies, budgets=None, match=False, **options):
    opts = bench_options(None, {"n_predict": 24, **options})
    return plan_bench(opts, policies, budgets, dataset="gsm8k", limit=1, out=None, match_budget=match,
                      fidelity=True, n_parallel=1, rescue=None)


def test_labels_are_canonical_whatever_was_typed():
    # knobs in the policy's declaration order, flag spelling, values as the flag parses them
    v = parse_variant(" zoomr: segment_tokens=64 : window=0128 ")
    assert v == Variant("zoomr:window=128:segment-tokens=64", "zoomr", (("window", 128), ("segment_tokens", 64)))
    assert parse_variant(v.label) == v
    assert parse_variant("snapkv") == Variant("snapkv", "snapkv", ())
    assert parse_variant("zoomr:summaries=model").knobs == (("summaries", "model"),)
    assert base_of("zoomr:window=8") == "zoomr" and base_of("rescue") == "rescue"
    assert cell_knob_fields("zoomr:window=8") == {"cell_knobs": {"window": 8}}
    assert cell_knob_fields("zoomr") == {} and cell_knob_fields("best-of-n") == {}


def test_cell_knobs_override_the_bench_wide_ones_for_that_cell_only():
    opts = bench_options(None, {"window": 64})
    assert parse_variant("zoomr:window=256").options(opts).policy_knobs() == {"window": 256}
    assert parse_variant("zoomr").options(opts).policy_knobs() == {"window": 64}


@pytest.mark.parametrize("text,message", [
    ("zoomr:windw=256", "--policies zoomr:windw=256: zoomr has no knob 'windw' (its knobs: window, topk-per-head, "
                        "consensus, summaries, segment-tokens)"),
    ("full:window=8", "--policies full:window=8: full has no knob 'window' (its knobs: none)"),
    ("rkv:budget=32", "--policies rkv:budget=32: the budget is not a cell knob (--budget or --match-budget sizes "
                      "every budgeted cell)"),
    ("zoomr:window=big", "--policies zoomr:window=big: window must be an integer, got 'big'"),
    ("zoomr:window=0", "--policies zoomr:window=0: --window must be at least 1 token, got 0"),
    ("zoomr:summaries=maybe", "--policies zoomr:summaries=maybe: --summaries 'maybe' unknown (choose from model, "
                              "prompted, auto)"),
    ("zoomr:window", "--policies zoomr:window: 'window' is not knob=value (as in zoomr:window=256)"),
    ("zoomr:", "--policies zoomr:: '' is not knob=value (as in zoomr:window=256)"),
    ("zoomr:window=8:window=9", "--policies zoomr:window=8:window=9: window given twice"),
])
def test_bad_variants_are_one_line_naming_the_cell(text, message):
    with pytest.raises(UserError) as e:
        parse_variant(text)
    assert str(e.value) == message


def test_plan_runs_a_policy_under_several_settings_and_matches_the_first_zoomr_cell():
    plan = _plan(["full", "zoomr:window=32:segment-tokens=16", "zoomr", "snapkv:window=4"], match=True)
    assert plan.policies == ["full", "zoomr:window=32:segment-tokens=16", "zoomr", "snapkv:window=4"]
    assert plan.cells == [("full", None), ("zoomr:window=32:segment-tokens=16", None), ("zoomr", None),
                          ("snapkv:window=4", "matched")]
    assert plan.target == "zoomr:window=32:segment-tokens=16"
    # each fixed cell's policy was built (and its knobs checked) once, under its own label
    assert {k for k in plan.factories} == {("full", None), ("zoomr:window=32:segment-tokens=16", None),
                                           ("zoomr", None)}


def test_plan_refusals_read_the_variants_policy():
    with pytest.raises(UserError, match="given more than once"):
        _plan(["zoomr:window=8", "zoomr: window=8"])
    with pytest.raises(UserError, match=r"unknown zoomer:window=8 \(choose from"):
        _plan(["full", "zoomer:window=8"])
    # a variant's knobs that do not fit together are the cell's refusal, before any model loads
    with pytest.raises(UserError, match=r"^cell streaming:sink=64 B=16: "):
        _plan(["full", "streaming:sink=64"], budgets=[16])
    # --match-budget needs ZoomR in some form; a variant of it is enough
    assert _plan(["zoomr:window=16", "h2o"], match=True).target == "zoomr:window=16"


@pytest.mark.slow
def test_a_cells_own_knob_runs_as_the_bench_wide_flag_would(tmp_path):
    """snapkv:window=4 beside snapkv in one bench gives the record a bench of snapkv with --window 4 gives."""
    common = dict(budgets=[16], limit=1, n_predict=16, dtype="fp32")
    one = zoomr.bench(policies="full,snapkv,snapkv:window=4", out=tmp_path / "one", **common)
    wide = zoomr.bench(policies="full,snapkv", window=4, out=tmp_path / "wide", **common)
    by = {r["policy"]: r for r in one["records"]}
    ref = {r["policy"]: r for r in wide["records"]}["snapkv"]
    assert set(by) == {"full", "snapkv", "snapkv:window=4"}
    assert by["snapkv:window=4"]["cell_knobs"] == {"window": 4} and "cell_knobs" not in by["snapkv"]
    # the knob took effect (another observation window, another distribution) and only in its own cell
    assert by["snapkv:window=4"]["fidelity_kl"] != by["snapkv"]["fidelity_kl"]
    for field in ("text", "mean_active_tokens", "fidelity_top1"):
        assert by["snapkv:window=4"][field] == ref[field], field
    assert by["snapkv:window=4"]["fidelity_kl"] == pytest.approx(ref["fidelity_kl"], rel=1e-6)
    rows = {(r["policy"], r["budget"]) for r in one["rows"]}
    assert ("snapkv:window=4", 16) in rows and ("snapkv", 16) in rows


@pytest.mark.slow
def test_cli_variant_cells_resume_and_match(tmp_path):
    out = tmp_path / "o"
    base = zoomr_cmd() + ["bench", "--limit", "1", "-n", "48", "--dtype", "fp32", "--no-live", "--out", str(out)]
    first = subprocess.run(base + ["--match-budget", "--policies", "full,zoomr:window=16:segment-tokens=16,streaming"],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=900)
    assert first.returncode == 0, first.stderr
    recs = [json.loads(l) for l in (out / "records.jsonl").read_text().splitlines()]
    by = {r["policy"]: r for r in recs}
    target = by["zoomr:window=16:segment-tokens=16"]
    assert target["cell_knobs"] == {"window": 16, "segment_tokens": 16}
    # the matched baseline aimed at the variant's measured KV, the only ZoomR cell of the bench
    assert by["streaming"]["target_active_tokens"] == pytest.approx(target["mean_active_tokens"])
    # the label is the resume key: the same typed in another order runs nothing again
    again = subprocess.run(base + ["--resume", "--match-budget", "--policies",
                                   "full,zoomr:segment_tokens=16:window=16,streaming"],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=900)
    assert again.returncode == 0, again.stderr
    assert len((out / "records.jsonl").read_text().splitlines()) == 3
    bad = subprocess.run(zoomr_cmd() + ["bench", "--limit", "1", "--policies", "full,zoomr:window=-3",
                                        "--out", str(tmp_path / "bad")], capture_output=True, text=True, cwd=ROOT,
                         env=ENV, timeout=300)
    assert_one_line_error(bad)
    assert "--policies zoomr:window=-3: --window must be at least 1 token, got -3" in bad.stderr
    assert not (tmp_path / "bad").exists()
