"""``zoomr chat`` with stdin piped: stdout carries the answers alone (no ``> `` prompts), one line per turn;
/stats, notes and errors go to stderr."""

import pytest

from conftest import zoomr


@pytest.mark.slow
def test_piped_chat_writes_only_answers_on_stdout():
    r = zoomr("chat", "--no-live", "-n", "4", "--temp", "0", stdin="What is 2+2?\n/stats\n/bogus\nSay hi.\n")
    assert r.returncode == 0, r.stderr
    answers = r.stdout.splitlines()
    assert len(answers) == 2 and all(a.strip() for a in answers), r.stdout
    assert not any(a.startswith(">") for a in answers), r.stdout
    assert "stats:" not in r.stdout
    assert "stats: prefill" in r.stderr and "conversation: turns 1" in r.stderr
    assert "unknown command /bogus" in r.stderr


@pytest.mark.slow
def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on():
    import subprocess

    from conftest import ENV, ROOT, zoomr_cmd

    r = subprocess.run(zoomr_cmd() + ["chat", "--no-live", "-n", "4", "--temp", "0"],
                       input=b"hi \xff\xfe there\nWhat is 2+2?\n/stats\n", capture_output=True, timeout=300,
                       env=ENV, cwd=ROOT)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "error: this line: not valid UTF-8 (byte 3)" in err and "Traceback" not in err
    assert len(r.stdout.decode().splitlines()) == 1           # one answer: the second line's
    assert "conversation: turns 1" in err


@pytest.mark.slow
def test_chat_asks_for_summaries_under_summaries_prompted_as_solve_does():
    import re

    def prefilled(summaries: str) -> int:
        r = zoomr("chat", "--no-live", "-n", "1", "--temp", "0", "--policy", "zoomr", "--summaries", summaries,
                  stdin="hi\n/stats\n")
        assert r.returncode == 0, r.stderr
        return int(re.search(r"stats: prefill (\d+) tok", r.stderr).group(1))

    # the instruction (a few dozen tokens) is in the system message of the first turn
    assert prefilled("prompted") > prefilled("auto") + 10
