"""``zoomr solve --policy ...`` as a user runs it: the ZoomR record, the live zoom events, bad knobs."""

import json

import pytest

from zoomr.backends.base import KVStats
from zoomr.kvstore.events import EventBus, RecomputeEvent
from conftest import assert_one_line_error, zoomr
from zoomr.factory import build_backend
from zoomr.cli.kv_display import attach_live_events, policy_line
from zoomr.prompts import system_with_summaries
from zoomr.options import RunOptions
from zoomr.cli.render import Output


@pytest.mark.slow
def test_solve_zoomr_records_policy_statistics(tmp_path):
    out = tmp_path / "run.json"
    # a small window, short segments and k = c = 1 so that 40 tokens are enough to leave segments out
    r = zoomr("solve", "examples/problem.txt", "--policy", "zoomr", "--window", "8", "--topk-per-head", "1",
              "--consensus", "1", "--segment-tokens", "8", "-n", "40", "--no-live", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    kv = rec["kv"]
    assert kv["policy"].startswith("zoomr(k=1, c=1, window=8")
    assert kv["full_tokens"] == rec["prompt_tokens"] + rec["tokens_generated"]
    assert kv["active_tokens"] < kv["full_tokens"] and kv["active_bytes"] < kv["full_bytes"]
    assert kv["mean_active_tokens"] <= kv["peak_active_tokens"] <= kv["full_tokens"]
    # saving compares time-averaged bytes over the same decode steps, the policy's own state (mean keys, queries)
    # included; the host copy is reported, not hidden
    assert kv["policy_state_bytes"] > 0
    assert kv["saving"] == pytest.approx(kv["mean_full_bytes"] / (kv["mean_active_bytes"]
                                                                  + kv["mean_policy_state_bytes"]), rel=1e-2)
    assert kv["host_kv_bytes"] >= kv["full_bytes"] and kv["device_kv_bytes"] >= kv["active_bytes"]
    assert kv["bound_measured"] and kv["bound_tokens"] <= kv["peak_active_tokens"]
    assert kv["saving"] > 1 and kv["recomputes"] >= 1 and kv["segments"] >= 1
    assert kv["summaries_mode"] == "paragraphs" and kv["summaries_option"] == "auto"
    assert 0 < kv["ag_mean"] <= 1 and kv["ag_std"] >= 0
    assert "KV policy zoomr" in r.stdout and "summaries: paragraphs" in r.stdout and "AG " in r.stdout
    assert kv["saving_formula"] > 1 and "§3.5 formula" in r.stdout
    assert "policy zoomr" in r.stderr                       # describe() names the policy


def test_bad_policy_knob_is_one_line_exit_2():
    r = zoomr("solve", "examples/problem.txt", "--no-live", "--policy", "h2o", "--budget", "0")
    assert_one_line_error(r)
    assert "--budget must be at least 1 token, got 0" in r.stderr


def test_bad_segment_length_is_one_line_exit_2():
    r = zoomr("solve", "examples/problem.txt", "--no-live", "--policy", "zoomr", "--segment-tokens", "0")
    assert_one_line_error(r)
    assert "--segment-tokens must be at least 1 token, got 0" in r.stderr


@pytest.mark.parametrize("opts,needle", [
    (RunOptions(policy="streaming", knobs={"budget": 8, "window": 8}), "--sink 4 + --window 8"),
    (RunOptions(policy="zoomr", knobs={"summaries": "bogus"}), "--summaries"),
    (RunOptions(policy="sumr", knobs={"segment_tokens": 0}), "--segment-tokens"),
    (RunOptions(policy="full", knobs={"budget": 0}), "--budget"),
])
def test_factory_rejects_bad_knobs_before_loading_the_model(opts, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        build_backend(opts)


@pytest.mark.parametrize("live", [True, False])
def test_live_display_prints_each_zoom_event(capsys, live):
    bus = EventBus()
    assert attach_live_events(bus, Output(live=live))
    assert not attach_live_events(None, Output(live=live))
    bus.emit(RecomputeEvent("zoomr", 120, [3, 5], [1, 2, 4], {1: 2, 2: 1, 3: 9, 4: 1, 5: 7}, 16 / 20, 180, 6,
                            "paragraphs"))
    captured = capsys.readouterr()
    assert "⟲ zoomr @120: zoom in [3, 5] · summaries [1, 2, 4] · AG 0.80 · 180 tok active · 6 segments (paragraphs)" \
        in captured.err and not captured.out
    bus.emit(RecomputeEvent("zoomr", 135, [0], [], {0: 60}, None, 136, 1, "paragraphs"))
    assert "136 tok active · 1 segment (paragraphs)" in capsys.readouterr().err


@pytest.mark.slow
def test_recompute_lines_only_with_verbose_and_json_dash_leaves_stdout_to_the_record():
    """-v prints one line per recompute on stderr; --json - puts the record alone on stdout, the rest on stderr."""
    args = ("solve", "examples/problem.txt", "--policy", "zoomr", "--window", "8", "--topk-per-head", "1",
            "--consensus", "1", "-n", "40", "--json", "-")
    loud = zoomr(*args, "-v", "--no-live")
    assert loud.returncode == 0, loud.stderr
    rec = json.loads(loud.stdout)  # nothing but the record
    events = [line for line in loud.stderr.splitlines() if line.startswith("⟲ zoomr @")]
    assert len(events) == rec["kv"]["recomputes"] >= 1
    text = " ".join(line for line in loud.stderr.splitlines() if not line.startswith("⟲"))  # the events cut in
    assert " ".join(rec["text"].split()) in " ".join(text.split())
    assert "answer:" in loud.stderr and "KV policy zoomr" in loud.stderr
    quiet = zoomr(*args)  # the live view, piped
    assert quiet.returncode == 0, quiet.stderr
    assert "⟲" not in quiet.stderr and "KV policy zoomr" in quiet.stderr
    assert json.loads(quiet.stdout)["text"] == rec["text"]  # greedy: -v changes what is shown, not the run


def test_policy_line_and_prompted_system_text():
    assert policy_line(KVStats(10, 10, 100, 100, 10)) is None
    kv = KVStats(50, 200, 500, 2000, 60, {"policy": "sumr(window=8, summaries=prompted)",
                                          "summaries_mode": "none", "summaries_option": "prompted", "segments": 0,
                                          "recomputes": 3}, mean_active_tokens=40.0, peak_active_bytes=600)
    line = policy_line(kv)
    assert "summaries: none (--summaries prompted)" in line and "saving 4.00×" in line and "peak 60" in line
    assert "formula" not in line
    kv.extra.update(saving_formula=3.5, formula_inputs={"n_prompt": 20, "n_generated": 180, "consensus": 2,
                                                        "mean_regular": 60.0, "mean_summary": 8.0, "n_voted": 3,
                                                        "window": 16})
    assert "§3.5 formula 3.50× (N_p 20, N_g 180, L̄_R 60, L̄_S 8, |I_all| 3, N_w 16)" in policy_line(kv)
    assert "<|begin_of_summary|>" in system_with_summaries(None, "zoomr", "prompted")
    assert system_with_summaries("Be brief.", "sumr", "prompted").startswith("Be brief.\n\n")
    assert system_with_summaries("Be brief.", "h2o", "prompted") == "Be brief."
    assert system_with_summaries(None, "zoomr", "auto") is None
