"""The CLI as a user runs it: subprocesses on the embedded model, and every kind of bad input."""

import json
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest

from conftest import ENV, ROOT, assert_one_line_error, sigint_default, wait_for, zoomr, zoomr_cmd
from zoomr.cli.options import gpu_layers_note
from zoomr.options import RunOptions

@pytest.mark.slow
def test_solve_json_record(tmp_path):
    out = tmp_path / "run.json"
    r = zoomr("solve", "examples/problem.txt", "-n", "12", "--no-live", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert 0 < rec["tokens_generated"] <= 12
    assert rec["text"] and rec["text"] in r.stdout
    assert rec["kv"]["full_tokens"] == rec["prompt_tokens"] + rec["tokens_generated"]
    assert rec["kv"]["active_tokens"] == rec["kv"]["full_tokens"]  # full KV policy
    assert rec["kv"]["full_bytes"] == rec["kv"]["full_tokens"] * 2 * 30 * 3 * 64 * 4  # fp32 KV on a CPU (auto)
    assert rec["timing"]["prefill_tok_s"] > 0 and rec["timing"]["decode_tok_s"] > 0
    assert "answer:" in r.stdout and "decode" in r.stdout
    assert f"wrote {out}" in r.stderr
    r = zoomr("solve", "examples/problem.txt", "-n", "4", "--no-live", "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["tokens_generated"] <= 4
    assert "wrote" not in r.stderr   # the record on stdout needs no "wrote stdout"


@pytest.mark.slow
def test_solve_from_stdin_prompt_too_long_for_ctx():
    r = zoomr("solve", "-", "-c", "32", "--no-live", stdin="What is 2+2? " * 20)
    assert_one_line_error(r)
    assert "-c 32" in r.stderr


@pytest.mark.parametrize("setup,args,needle", [
    (None, ["missing.txt"], "no such file"),
    ("empty", ["{p}"], "empty"),
    ("binary", ["{p}"], "binary"),
    ("latin1", ["{p}"], "UTF-8"),
    (None, ["examples/problem.txt", "-m", "nope/missing.gguf"], "no such model"),
    # a bare name is a mistyped alias: the refusal lists the aliases there are
    (None, ["examples/problem.txt", "-m", "smollm2-summarys"], "not a model alias (aliases: default, smollm2-135m, "),
    ("noise", ["examples/problem.txt", "-m", "{p}"], "GGUF"),
    ("dir", ["examples/problem.txt", "-m", "{p}"], "config.json"),
    (None, ["examples/problem.txt", "--top-p", "2"], "top-p"),
    (None, ["examples/problem.txt", "--temp", "-1"], "temp"),
    (None, ["examples/problem.txt", "--temp", "1e309"], "--temp must be a finite number"),
    (None, ["examples/problem.txt", "-s", "-1"], "-s/--seed must be >= 0"),   # before the model loads
    (None, ["examples/problem.txt", "--backend", "vllm"], "backend"),
    (None, ["examples/problem.txt", "--json", "/nonexistent/dir/x.json"], "does not exist"),
    (None, ["-p", "   "], "empty"),
    (None, ["examples/problem.txt", "--nb", "3"], "--nb needs --rescue"),
    (None, ["examples/problem.txt", "--no-detector"], "--no-detector needs --rescue"),
    (None, ["examples/problem.txt", "-np", "2"], "-np/--parallel: zoomr solve decodes one sequence"),  # not "-n p"
])
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2(tmp_path, setup, args, needle):
    p = tmp_path / "input"
    if setup == "empty":
        p.write_text("  \n")
    elif setup == "binary":
        p.write_bytes(b"\x7fELF\x00\x01\x02")
    elif setup == "latin1":
        p.write_bytes("café au lait".encode("latin-1"))
    elif setup == "noise":
        p = tmp_path / "noise.gguf"
        p.write_bytes(os.urandom(8192))
    elif setup == "dir":
        p.mkdir()
    r = zoomr("solve", *[a.format(p=p) for a in args], "--no-live")
    assert_one_line_error(r)
    assert needle.lower() in r.stderr.lower()


def test_unknown_option_is_usage_error():
    r = zoomr("solve", "--frobnicate")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_help_lists_commands_and_llamacpp_flags():
    r = zoomr("--help")
    assert r.returncode == 0 and "solve" in r.stdout and "chat" in r.stdout
    r = zoomr("solve", "--help")
    for flag in ("-m", "-c", "-n", "-t", "-s", "--temp", "--top-k", "--top-p", "-p", "-f", "-ngl", "--json"):
        assert flag in r.stdout


@pytest.mark.parametrize("flag", ["--version", "-V"])
@pytest.mark.slow
def test_version(flag):
    r = zoomr(flag)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (r.returncode, r.stdout, r.stderr) == (0, f"zoomr {version}\n", "")
    assert metadata.version("zoomr") == version  # the installed distribution's, as printed


def _help(*command: str) -> str:
    r = subprocess.run(zoomr_cmd() + [*command, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**ENV, "COLUMNS": "200"})  # one row per option: defaults are not wrapped away
    assert r.returncode == 0, r.stderr
    return r.stdout


def _default(text: str, flag: str) -> str:
    return re.search(rf"{flag}\s.*?\[default: (.*?)\]\s*│", text).group(1)


@pytest.mark.slow
def test_help_has_no_type_tags_and_shows_defaults():
    helps = {cmd: _help(cmd) for cmd in ("solve", "chat", "bench")}
    for text in [_help(), *helps.values()]:
        assert not re.search(r"<(bool|str|int|float|list\[\w+\])>", text), text
    assert re.search(r"--n-predict\s+-n\s+N\s", helps["solve"]) and re.search(r"--model\s+-m\s+MODEL\s", helps["chat"])
    assert _default(helps["solve"], "--temp") == "(0, greedy; 0.8 with --rescue)"
    assert _default(helps["chat"], "--temp") == "0.7"
    assert {_default(t, "--top-k") for t in helps.values()} == {"20"}  # one default across commands
    assert _default(helps["solve"], "--n-gpu-layers") == "(-1, all)"


@pytest.mark.parametrize("backend", ["llamacpp", "torch"])
@pytest.mark.parametrize("ngl", [99, 1, -1, 0])
def test_gpu_layers_note_only_where_ngl_does_nothing(backend, ngl):
    import torch
    from zoomr.backends.llamacpp.runtime import gpu_offload_supported

    note = gpu_layers_note(RunOptions(backend=backend, n_gpu_layers=ngl))
    gpu = gpu_offload_supported() if backend == "llamacpp" else torch.cuda.is_available()
    if gpu or ngl <= 0:   # 0 keeps the CPU and -1 is the default ("all, where there is a GPU"): nothing to say
        assert note is None
    else:
        assert note.startswith(f"-ngl {ngl} has no effect") and "\n" not in note


def test_gpu_layers_note_defers_to_an_explicit_device():
    import torch

    # --device cuda where torch has no CUDA is refused with its own error: no note saying "runs on the CPU" first
    assert gpu_layers_note(RunOptions(backend="torch", n_gpu_layers=99, device="cuda")) is None
    note = gpu_layers_note(RunOptions(backend="torch", n_gpu_layers=99, device="cpu"))
    assert note == "-ngl 99 has no effect: --device cpu places the model"
    if not torch.cuda.is_available():
        assert "no CUDA device" in gpu_layers_note(RunOptions(backend="torch", n_gpu_layers=99))


@pytest.mark.slow
def test_ngl_on_a_cpu_build_is_named_once():
    from zoomr.backends.llamacpp.runtime import gpu_offload_supported

    if gpu_offload_supported():
        pytest.skip("this llama.cpp build offloads to a GPU: -ngl has an effect")
    r = zoomr("solve", "-p", "1+1?", "-n", "2", "--backend", "llamacpp", "-t", "1", "-ngl", "99", "--no-live")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "no effect" in line] == \
        ["zoomr: -ngl 99 has no effect: this llama.cpp build has no GPU offload, every layer runs on the CPU"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_ctrl_c_keeps_partial_result(tmp_path, stop):
    """SIGINT (Ctrl-C) or SIGTERM (kill) mid-generation: exit 130, the text so far printed and written to --json."""
    import signal
    import time

    out, streamed = tmp_path / "partial.json", tmp_path / "stdout.txt"
    with streamed.open("w") as sink:
        p = subprocess.Popen(zoomr_cmd() + ["solve", "examples/problem.txt", "-n", "2000", "--no-live", "--json",
                                            str(out)], stdout=sink, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=ROOT, preexec_fn=sigint_default)
    # wait until tokens stream, then interrupt
    wait_for(lambda: len(streamed.read_text(errors="replace")) >= 40, p, 300, "40 characters of streamed text")
    first = streamed.read_text(errors="replace")[:40]
    time.sleep(0.5)
    p.send_signal(getattr(signal, stop))
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    rec = json.loads(out.read_text())
    assert rec["stop_reason"] == "interrupted" and 0 < rec["tokens_generated"] < 2000
    assert rec["text"].startswith(first.strip()[:10])


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory no file can be created in: a mode-555 folder, or (as root, whom modes do not stop) /sys."""
    from zoomr.cli.inputs import unwritable

    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        for cand in (d, Path("/sys")):
            if cand.is_dir() and unwritable(cand) is not None:
                yield cand
                return
        pytest.skip("no unwritable directory on this machine")
    finally:
        os.chmod(d, 0o755)


def test_json_into_an_unwritable_directory_is_refused_before_the_model_loads(unwritable_dir):
    r = zoomr("solve", "-p", "2+2?", "-n", "2", "--no-live", "--json", str(unwritable_dir / "r.json"))
    assert_one_line_error(r)
    assert r.stderr.strip().startswith(f"zoomr: error: --json {unwritable_dir / 'r.json'}: cannot write there (")
    assert "loading model" not in r.stderr


def test_bench_out_unwritable_is_refused_before_the_model_loads(unwritable_dir):
    r = zoomr("bench", "--limit", "1", "-n", "2", "--policies", "full", "--no-live", "--out", str(unwritable_dir))
    assert_one_line_error(r)
    assert r.stderr.strip().startswith(f"zoomr: error: --out {unwritable_dir}: cannot write there (")
    assert "loading model" not in r.stderr


def test_a_record_that_cannot_be_written_at_the_end_goes_to_the_temp_dir(unwritable_dir):
    """The check at the start passed, then the path failed (disk full, mount gone): the record is kept elsewhere."""
    from zoomr.cli.inputs import write_json
    from zoomr.errors import UserError

    record = {"answer": "4", "tokens": [1, 2, 3]}
    with pytest.raises(UserError, match="cannot write .* the record was written to ") as e:
        write_json(str(unwritable_dir / "r.json"), record, indent=2)
    kept = Path(str(e.value).rsplit("written to ", 1)[1].removesuffix(" instead"))
    try:
        assert json.loads(kept.read_text()) == record
    finally:
        kept.unlink()


@pytest.mark.parametrize("flags,needle", [
    (["--quant", "int3"], "--quant"), (["--dtype", "fp64"], "--dtype"), (["--kv-dtype", "fp8"], "--kv-dtype"),
    (["-c", "0"], "-c 0"), (["--quant", "fp16", "--dtype", "bf16"], "--quant fp16"),
    (["--rescue", "--dtype", "fp64"], "--dtype"),
    # llama.cpp places layers with -ngl and computes in the file's types: these would do nothing there
    (["--backend", "llamacpp", "--device", "cpu"], "--device cpu applies to the torch backend"),
    (["--backend", "llamacpp", "--dtype", "fp32"], "--dtype fp32 applies to the torch backend"),
    (["-ngl", "-5"], "-ngl -5: give a number of layers >= 0, or -1 for all"),
    # a policy size of -c or more evicts nothing before the context stops the run: full KV under another name
    (["--policy", "rkv", "--budget", "5000"], "--budget 5000 is not below -c 4096"),
    (["--policy", "zoomr", "--window", "64", "-c", "64"], "--window 64 is not below -c 64"),
    (["--policy", "streaming", "--sink", "300", "-c", "300"], "--sink 300 is not below -c 300"),
    (["--rescue", "--budget", "9000"], "--budget 9000 is not below -c"),
    # the -ngl note ("has no effect ... CPU") is said when the model loads, so a refused run prints its error alone
    (["-ngl", "99", "--policy", "rkv", "--budget", "9999"], "--budget 9999"),
    # the policy is built as the backend builds it, with the flags (it came after "loading model…")
    (["--backend", "llamacpp", "--policy", "h2o", "--selection", "per-head"], "shared selection only"),
    # the rescue loop ends at a committed end-of-sequence: --ignore-eos was accepted and did nothing
    (["--rescue", "--ignore-eos"], "--ignore-eos does not apply to --rescue"),
])
@pytest.mark.slow
def test_bad_model_flags_are_refused_before_the_model_loads(flags, needle):
    r = zoomr("solve", "-p", "2+2?", "-n", "2", "--no-live", *flags)
    assert_one_line_error(r)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no "loading model…" (or note) before the error
    assert needle in r.stderr


def test_bench_refuses_a_budget_not_below_the_context(tmp_path):
    r = zoomr("bench", "--budget", "64", "--budget", "5000", "--limit", "1", "-n", "4", "--no-live",
              "--out", str(tmp_path / "b"))
    assert_one_line_error(r)
    assert "--budget 5000 is not below -c 4096" in r.stderr and not (tmp_path / "b").exists()


def test_a_llamacpp_context_larger_than_memory_is_refused_before_allocating():
    from zoomr.backends.llamacpp.engine import check_kv_fits
    from zoomr.backends.memory import host_available_bytes

    free = host_available_bytes()
    assert free and free > 0
    with pytest.raises(ValueError, match=r"^-c 123: llama.cpp's KV cache of 4096 cells needs .* GiB, more than"):
        check_kv_fits(4096, free // 4096 + 1, 123, on_gpu=False)
    check_kv_fits(4096, free // 4096 - 1, 123, on_gpu=False)   # fits: no error
    check_kv_fits(4096, free, 123, on_gpu=True)                 # on a GPU llama.cpp itself reports it
    r = zoomr("solve", "-p", "2+2?", "-n", "2", "--no-live", "--backend", "llamacpp", "-c", "1000000000")
    assert_one_line_error(r)     # was exit 1 after a minute of failed allocation
    assert "-c 1000000000: llama.cpp's KV cache" in r.stderr


@pytest.mark.slow
def test_bench_help_offers_only_the_backend_it_runs():
    # bench refuses --backend llamacpp, so its help must not offer it; solve's still does
    bench_row = re.search(r"--backend\s.*", _help("bench")).group(0)
    assert "torch only" in bench_row and "llamacpp" not in bench_row
    assert "llamacpp" in re.search(r"--backend\s.*", _help("solve")).group(0)


@pytest.mark.slow
def test_a_context_past_the_trained_one_is_named_on_the_model_line():
    r = zoomr("solve", "-p", "What is 2+2?", "-n", "1", "-c", "20000", "--no-live")
    assert r.returncode == 0, r.stderr
    assert "-c 20000 is past the trained context of 8192 positions" in r.stdout + r.stderr
    r = zoomr("solve", "-p", "What is 2+2?", "-n", "1", "-c", "8192", "--no-live")
    assert r.returncode == 0 and "past the trained context" not in r.stdout + r.stderr
