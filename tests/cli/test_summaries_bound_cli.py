"""``zoomr solve --summaries model`` on a model that writes no summary (the embedded one), both backends: the
segments are cut as in ``auto`` after 4 × --segment-tokens tokens, one note says so, the record counts it."""

import json

import pytest

from conftest import zoomr

NOTE = "zoomr: note: the model wrote no summary in 64 tokens; segments are cut as in --summaries auto"


@pytest.mark.slow
@pytest.mark.parametrize("backend,policy", [("torch", "zoomr"), ("llamacpp", "sumr")])
def test_model_mode_without_summaries_says_so_once_and_counts_the_blocks(tmp_path, backend, policy):
    out = tmp_path / "run.json"
    # torch runs its int4 path (--dtype bf16), whose text runs the full -n without an end of sequence
    dtype = ["--dtype", "bf16"] if backend == "torch" else []
    r = zoomr("solve", "examples/problem.txt", "--backend", backend, "-t", "1", "--policy", policy,
              "--summaries", "model", "--segment-tokens", "16", "--window", "8", "-n", "120", "--no-live",
              *dtype, "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "note:" in line] == [NOTE], r.stderr
    rec = json.loads(out.read_text())
    kv = rec["kv"]
    assert rec["tokens_generated"] == 120 and "a summary within 64 tok" in kv["policy"]
    assert kv["summaries_written"] == 0 and kv["segments_cut_auto"] == kv["segments"] >= 4
    assert kv["summaries_option"] == "model" and kv["summaries_mode"] == "paragraphs"
    # before the bound every position stayed active: no segment ever closed
    assert kv["active_tokens"] < kv["full_tokens"]
