"""``zoomr solve --rescue`` as a user runs it: both backends for the base, Ctrl-C, bad input.

Runs use one thread (``-t 1``): on a shared 2-core machine two spinning threads are several times slower.
"""

import dataclasses
import json
import signal
import subprocess

import pytest

from zoomr.backends.llamacpp.policies import STREAMING_BUFFER
from conftest import ROOT, sigint_default, wait_for, zoomr_cmd
from conftest import ENV, assert_one_line_error, zoomr
from zoomr.errors import UserError
from zoomr.options import RunOptions
from zoomr.rescue.plan import RescueOptions, plan_rescue
from zoomr.cli.rescue_options import needs_rescue

# GSM8K test #1199: long enough (~230 prompt tokens) that the base evicts from its prompt on
PROBLEM = ("Fred was preparing for a party to be held in four days.  So, he made 24 gallons of root beer on the first "
           "day and put them in the refrigerator cooler.  But later that evening, his children discovered the delicious "
           "nectar and robbed the cooler, drinking 4 of those gallons of root beer.  On the second day, his wife Barbie "
           "also discovered the root beer and accidentally spilled 7 gallons. On the third day, Fred's friend Ronnie "
           "visited Fred's house and helped himself to the root beer, further reducing the amount remaining by 5 "
           "gallons.  On the fourth day, 3 people showed up for the party.  If Fred and the others shared the "
           "remaining root beer equally, how much was available for each to drink during the party?")


def check_record(rec: dict, steps_max: int, step_tokens: int, kv_bound: int) -> None:
    """What every rescue JSON must hold, cross-checked against its own events."""
    assert 1 <= len(rec["steps"]) <= steps_max
    for st in rec["steps"]:
        assert st["source"] in ("base", "helper") and 0 <= st["tokens"] <= step_tokens and isinstance(st["score"], float)
    ev = rec["events"]
    assert ev[0]["event"] == "run_started" and ev[-1]["event"] == "run_finished"
    assert rec["base_tokens"] == sum(e["event"] == "token" and e["source"] == "base" for e in ev)
    assert rec["helper_tokens"] == sum(e["event"] == "token" and e["source"] == "helper" for e in ev)
    assert rec["aborted"] == sum(e["event"] == "candidate_aborted" for e in ev)
    assert rec["candidates"] == {"base": 2 * len(rec["steps"]), "helper": len(rec["steps"])} or \
        rec["stop_reason"] == "eos"
    assert rec["kv"]["base"]["active_tokens"] <= kv_bound < rec["kv"]["base"]["full_tokens"]   # evicted
    assert rec["kv"]["helper"]["active_tokens"] == rec["kv"]["helper"]["full_tokens"]          # full KV
    assert "log-likelihood" in rec["scorer"] and "no --prm" in rec["scorer"]


@pytest.mark.slow
@pytest.mark.parametrize("backend,policy,step_tokens,bound", [
    # R-KV keeps the ~200-token prompt whole until position 256 is written (in the second of 3 steps of 32 tokens),
    # so it attends up to 256 + 1 in a decode step, or 256 + 32 in a forward that prefills the helper's step
    ("torch", "rkv", 32, 256 + 32),
    ("llamacpp", "streaming", 24, 32 + STREAMING_BUFFER),            # llama.cpp streaming: B + its eviction buffer
])
def test_rescue_end_to_end(tmp_path, backend, policy, step_tokens, bound):
    # the llama.cpp run writes its record to stdout (--json -): the steps and results then go to stderr
    out = tmp_path / "run.json" if backend == "torch" else "-"
    r = zoomr("solve", "-p", PROBLEM, "--rescue", "--backend", backend, "--budget", "32", "-t", "1",
              "--max-steps", "3", "--step-tokens", str(step_tokens), "--nb", "2", "--nh", "1",
              "--no-live", "--json", str(out))
    assert r.returncode == 0, r.stderr
    # the default helper is the base's own model: torch shares its weights, llama.cpp loads a second context
    said = r.stdout + r.stderr
    assert ("no second load" in said) == (backend == "torch")
    assert ("loading helper model" in said) == (backend != "torch")
    # no --prm: the fallback scorer loads nothing, and the run says which scorer it is
    assert "loading scorer" not in said and "scorer: helper mean log-likelihood" in said
    rec = json.loads(r.stdout if out == "-" else out.read_text())
    shown = r.stderr if out == "-" else r.stdout
    assert rec["settings"]["base_policy"] == policy and f"KV policy {policy}" in rec["base"]
    check_record(rec, 3, step_tokens, bound)
    # the plain view printed every committed step, the summary lines name sources and tokens
    for i, st in enumerate(rec["steps"]):
        assert f"[step {i + 1} · {st['source']} · score {st['score']:.3f}" in shown
    assert f"generated base {rec['base_tokens']} tok" in shown and "answer:" in shown


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_writes_what_was_committed(tmp_path, stop):
    out, printed = tmp_path / "run.json", tmp_path / "stdout.txt"
    with printed.open("w") as sink:
        p = subprocess.Popen(zoomr_cmd() + ["solve", "-p", PROBLEM, "--rescue", "--backend", "llamacpp", "-t", "1",
                                            "--step-tokens", "16", "--nb", "1", "--nh", "1", "--no-live", "--json",
                                            str(out)], stdout=sink, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=ROOT, preexec_fn=sigint_default)
    try:  # wait for the first committed step, then interrupt mid-run
        wait_for(lambda: "\n[step 1 ·" in "\n" + printed.read_text(errors="replace"), p, 600,
                 "the first committed step")
        p.send_signal(getattr(signal, stop))
        _, stderr = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, stderr
    rec = json.loads(out.read_text())
    assert rec["stop_reason"] == "interrupted" and len(rec["steps"]) >= 1
    assert "interrupted" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_a_run_cut_by_max_steps_takes_no_answer_from_a_cut_expression():
    """A rescue run that stops anywhere but EOS may have cut its last answer (here, seed 0: the one 8-token step
    ends "The answer is 3+"): its answer is read as a truncated solve's is, never "3"."""
    from zoomr.grading import extract_answer

    # --dtype bf16: the int4 path, whose greedy text this test reads (another path writes another step)
    r = zoomr("solve", "-p", "What is 3+4?", "--rescue", "--nb", "1", "--nh", "1", "--max-steps", "1",
              "--step-tokens", "8", "-t", "1", "--dtype", "bf16", "--json", "-")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    text = "".join(st["text"] for st in rec["steps"])
    assert rec["stop_reason"] == "max_steps"
    assert extract_answer(text) is not None   # read as a whole text, its tail looks like an answer
    assert rec["answer"] is None and extract_answer(text, truncated=True) is None, (text, rec["answer"])


@pytest.mark.slow
def test_n_bounds_the_committed_trajectory():
    """``-n`` caps what ``solve --rescue`` commits after the prompt, as it caps a plain solve: stop ``length``."""
    r = zoomr("solve", "-p", "Count from 1 to 100, one number per line.", "--rescue", "--nb", "1", "--nh", "1",
              "--step-tokens", "8", "-n", "20", "-t", "1", "--json", "-")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["stop_reason"] == "length", rec["stop_reason"]
    # the last step is cut to what is left, so no more than 20 tokens in either model's count
    assert 20 - 8 < sum(st["tokens"] for st in rec["steps"]) <= 20


def test_bad_input_is_one_line_exit_2():
    r = zoomr("solve", "-p", PROBLEM, "--rescue", "--nb", "0", "--nh", "0")
    assert_one_line_error(r)
    assert "--nb 0 --nh 0" in r.stderr


@pytest.mark.parametrize("ropts,opts,needle", [
    (RescueOptions(rescue=True, base_policy="lru"), RunOptions(), "--base-policy 'lru' unknown"),
    (RescueOptions(rescue=True), RunOptions(policy="rkv"), "--base-policy"),
    (RescueOptions(rescue=True, nb=-1), RunOptions(), "--nb and --nh"),
    (RescueOptions(rescue=True, abort_gzip=float("nan")), RunOptions(), "--abort-gzip"),
    (RescueOptions(rescue=True, abort_copies=1), RunOptions(), "--abort-copies"),
    (RescueOptions(rescue=True, abort_repeat=-5), RunOptions(), "--abort-repeat"),
    (RescueOptions(rescue=True, preset="nope"), RunOptions(), "rescue_nope.toml"),
    (RescueOptions(rescue=True, base_policy="zoomr"), RunOptions(backend="llamacpp"),
     "--base-policy: --policy zoomr on --backend llamacpp cannot fork"),
    (RescueOptions(rescue=True), RunOptions(knobs={"budget": 8}), "--base-policy: rkv: --budget 8"),
    (RescueOptions(rescue=True, prm="/nonexistent/prm"), RunOptions(), "--prm"),
    (RescueOptions(rescue=True, helper="nope/missing.gguf"), RunOptions(), "--helper: nope/missing.gguf: no such model"),
    # the paper preset names hub models; offline and uncached they are refused before anything loads
    (RescueOptions(rescue=True, preset="paper"), RunOptions(), "Qwen/Qwen2.5-Math-7B-Instruct"),
    (RescueOptions(rescue=True, detector="gzip"), RunOptions(), "--detector 'gzip' unknown (choose from zoomr, paper)"),
    # the paper's detector has no cycle rule: a threshold only zoomr's reads is named, not ignored
    (RescueOptions(rescue=True, detector="paper", abort_repeat=128), RunOptions(),
     "--abort-repeat is read by --detector zoomr only"),
    (RescueOptions(rescue=True, detector="paper", abort_copies=0), RunOptions(),
     "--abort-copies is read by --detector zoomr only"),
])
def test_flags_are_checked_before_any_model_loads(ropts, opts, needle):
    with pytest.raises((UserError, ValueError)) as e:
        plan_rescue(ropts, opts)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_every_rescue_flag_without_rescue_is_refused_by_name():
    values = {"base_policy": "rkv", "helper": "m", "prm": "p", "abort_entropy": 1.0, "abort_gzip": 0.1,
              "detector": "paper", "early_exit": True, "preset": "paper"}
    for name in (f.name for f in dataclasses.fields(RescueOptions) if f.name != "rescue"):
        flag = "--" + name.replace("_", "-")
        with pytest.raises(UserError, match=f"^{flag} needs --rescue$"):
            needs_rescue(RescueOptions(**{name: values.get(name, 1)}))
        assert needs_rescue(RescueOptions(rescue=True, **{name: values.get(name, 1)})).rescue
    with pytest.raises(UserError, match="^--no-detector needs --rescue$"):
        needs_rescue(RescueOptions(early_exit=False))
    assert needs_rescue(RescueOptions()) == RescueOptions()


def test_plan_defaults_and_backend_choice():
    plan = plan_rescue(RescueOptions(rescue=True), RunOptions())
    c = plan.config
    assert (c.nb, c.nh, c.step_tokens, c.max_steps, c.max_context, c.max_new_tokens) == (2, 2, 512, 1024, 4096, 512)
    assert plan_rescue(RescueOptions(rescue=True), RunOptions(n_predict=-1)).config.max_new_tokens == -1
    assert (c.detector.max_entropy, c.detector.entropy_window, c.detector.entropy_guard,
            c.detector.min_gzip_ratio, c.detector.gzip_window, c.detector.repeat_chars,
            c.detector.max_copies) == (7.0, 12, 24, 0.18, 800, 256, 64)
    off = plan_rescue(RescueOptions(rescue=True, abort_repeat=0, abort_copies=0), RunOptions()).config.detector
    assert (off.repeat_chars, off.max_copies) == (0, 0)
    assert plan.base_opts.policy == "rkv" and plan.helper_opts.policy == "full" and plan.prm is None
    assert c.early_exit is True   # the detector is on unless --no-detector
    assert c.detector.name == "zoomr"   # the calibrated detector unless --detector paper
    llama = plan_rescue(RescueOptions(rescue=True, nh=0), RunOptions(backend="llamacpp"))
    assert llama.base_opts.policy == "streaming" and llama.config.nh == 0 and llama.notes


@pytest.mark.slow
def test_no_detector_is_the_papers_eviction_only_best_of_n(tmp_path):
    """--nh 0 --no-detector: a detector that would abort every base candidate at its first token aborts none."""
    out = tmp_path / "bon.json"
    r = zoomr("solve", "-p", PROBLEM, "--rescue", "--budget", "32", "-t", "1", "--max-steps", "2",
              "--step-tokens", "4", "--nb", "1", "--nh", "0", "--no-detector", "--abort-entropy", "0",
              "--entropy-guard", "0", "--no-live", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["settings"]["early_exit"] is False and rec["aborted"] == 0 and len(rec["steps"]) == 2
    assert "detector off" in r.stderr
    kv = rec["kv_trajectory"]["base"]
    # R-KV attends the ~200-token prompt whole until position 256 is written: its bound is 256 + 1, not B + 128
    assert rec["kv"]["base"]["bound_tokens"] == 256 + 1
    assert kv["tokens"] == sum(st["tokens"] for st in rec["steps"]) and kv["mean_active_tokens"] <= 256 + 1


def test_the_cli_runs_the_library_runner(tmp_path, monkeypatch, capsys):
    """``zoomr solve --rescue`` loads and renders; the run is the library's (zoomr.rescue.runner.run_rescue):
    a subscriber given to it sees exactly the events the ``--json`` record lists."""
    import zoomr.cli.rescue as cli_rescue
    from zoomr.cli.render import Output
    from zoomr.rescue import runner

    calls, seen = [], []

    def spy(base, problem, *, on_event, **kw):
        calls.append((problem, kw))
        return runner.run_rescue(base, problem, on_event=lambda ev: (seen.append(ev.as_dict()), on_event(ev)), **kw)

    monkeypatch.setattr(cli_rescue, "run_rescue", spy)
    out = tmp_path / "run.json"
    code = cli_rescue.solve_with_rescue("What is 2 + 3?", "Be brief.", str(out), Output(live=False),
                                        RunOptions(threads=1, knobs={"budget": 32}),
                                        RescueOptions(rescue=True, nb=1, nh=1, max_steps=1, step_tokens=4))
    assert code == 0 and len(calls) == 1
    problem, kw = calls[0]
    assert problem == "What is 2 + 3?" and kw["system"] == "Be brief."   # the user's --system, as given
    rec = json.loads(out.read_text())
    assert seen and json.loads(json.dumps(seen)) == rec["events"]
    assert rec["settings"]["base_policy"] == "rkv" and rec["settings"]["budget"] == 32
    assert f"[step 1 · {rec['steps'][0]['source']}" in capsys.readouterr().out

