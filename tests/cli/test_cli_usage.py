"""Command-line parse errors (unknown option, bad value, unknown command) are one ``zoomr: error:`` line, exit 2.

Most cases run :func:`zoomr.cli.app.main` in this process (the parse fails before any command runs, so no
model loads); one runs the console script as a user would.
"""

import subprocess

import pytest

from conftest import ENV, ROOT, zoomr, zoomr_cmd
from zoomr.cli.app import main


def one_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("zoomr: error: "), err
    assert "Traceback" not in err and "Usage:" not in err
    return lines[0]


@pytest.mark.parametrize("args,needles", [
    (["solve", "--nope"], ["solve: no such option --nope"]),
    (["solve", "--top-kk", "3"], ["no such option --top-kk; did you mean --top-k"]),   # the closest first
    (["solve", "--topk-per-hed", "3"], ["--topk-per-head"]),
    (["bench", "-np2x"], ["bench: -np/--parallel '2x':"]),   # glued to its value: -np's, not -n's, to blame
    (["chat", "--nope"], ["chat: no such option --nope"]),
    (["bench", "--nope"], ["bench: no such option --nope"]),
    (["solve", "-n", "abc", "x.txt"], ["solve: -n/--n-predict 'abc':", "integer"]),
    (["solve", "--n-predict=abc", "x.txt"], ["-n/--n-predict 'abc':"]),
    (["bench", "--budget", "x"], ["bench: --budget 'x':", "integer"]),
    (["chat", "--temp", "hot"], ["chat: --temp 'hot':", "number"]),
    (["solve", "--top-k"], ["--top-k", "requires an argument"]),
    (["solve", "--ignore-eos=3"], ["--ignore-eos", "does not take a value"]),
    (["solve", "a.txt", "b.txt"], ["solve: got unexpected extra argument", "b.txt"]),
    (["nosuchcommand"], ["no such command 'nosuchcommand'", "commands: bench, calibrate, chat, finetune, solve"]),
    (["slove", "x.txt"], ["no such command 'slove'; did you mean solve?"]),
    (["--nope"], ["no such option --nope"]),
])
def test_parse_error_is_one_line_exit_2(capsys, args, needles):
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    line = one_line(err)
    for needle in needles:
        assert needle in line, line


def test_help_and_version_are_not_errors(capsys):
    assert main(["solve", "--help"]) == 0
    out, err = capsys.readouterr()
    assert "Usage: zoomr solve" in out and err == ""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("zoomr ")


@pytest.mark.slow
def test_console_script_parse_error_and_debug_usage():
    r = zoomr("solve", "--nope", "x.txt")
    assert r.returncode == 2 and r.stdout == ""
    assert one_line(r.stderr) == ("zoomr: error: solve: no such option --nope; "
                                  "did you mean --no-live, --compile or --top-p?")
    # ZOOMR_DEBUG=1 shows click's usage block as well, then the same line
    r = subprocess.run(zoomr_cmd() + ["solve", "--nope"], capture_output=True, text=True, cwd=ROOT,
                       env={**ENV, "ZOOMR_DEBUG": "1"}, timeout=120)
    assert r.returncode == 2
    assert "Usage: zoomr solve" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("zoomr: error: solve: no such option --nope")


def test_bare_zoomr_still_shows_help():
    r = zoomr()
    assert r.returncode == 2
    assert "Usage: zoomr" in r.stdout + r.stderr and "solve" in r.stdout + r.stderr
    assert "zoomr: error" not in r.stderr
    assert r.stderr == "" or r.stderr.strip()   # no stray empty line


@pytest.mark.parametrize("flag,value,choices", [
    ("--dtype", "fp8", "(choose from auto, fp32, float32, bf16, bfloat16, fp16, float16)"),
    ("--device", "tpu", "(choose from auto, cpu, cuda, cuda:N)"),
    ("--device", "meta", "(choose from auto, cpu, cuda, cuda:N)"),
    ("--kv-dtype", "int8", "(choose from auto, fp32, float32, bf16, bfloat16, fp16, float16)"),
])
@pytest.mark.slow
def test_bad_dtype_or_device_names_the_flag_and_every_choice(flag, value, choices):
    r = zoomr("solve", "examples/problem.txt", flag, value, "--no-live")
    assert r.returncode == 2
    line = one_line(r.stderr.replace("loading model…", ""))
    assert line == f"zoomr: error: {flag} {value!r} unknown {choices}"
