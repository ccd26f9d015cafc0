"""``zoomr chat`` in a real pseudo-terminal: question in, streamed answer out, /stats, /exit."""

import io
import os
import sys

import pexpect
import pytest

from conftest import ROOT, sigint_default


@pytest.mark.slow
def test_chat_session_in_a_pty():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    transcript = io.StringIO()
    child = pexpect.spawn(sys.executable, ["-m", "zoomr", "chat", "--no-live", "-n", "400", "--temp", "0"],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=240,
                          preexec_fn=sigint_default)
    child.logfile_read = transcript
    try:  # every expect returns at once (pexpect.EOF) when the child exits: no wait on a dead chat
        child.expect_exact("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"KV (\d+)/(\d+) tok")
        first_turn_kv = int(child.match.group(2))
        child.expect_exact("> ")
        child.sendline("And of Italy?")
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"KV (\d+)/(\d+) tok.*cache rebuilds (\d+)")
        # the second turn extended the same cache instead of re-prefilling the conversation
        assert int(child.match.group(2)) > first_turn_kv
        assert child.match.group(3) == "0"
        # Ctrl-C mid-answer stops that answer and returns to the prompt; the session lives on
        child.sendline("Write a long story about a dragon.")
        child.expect_exact("dragon.\r\n")  # the terminal's echo of our line
        child.expect(r"\w+ \w+ \w+")  # the answer is streaming
        child.sendintr()
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect("stop: interrupted")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    except (pexpect.EOF, pexpect.TIMEOUT) as e:
        child.close()
        pytest.fail(f"chat {'exited' if isinstance(e, pexpect.EOF) else 'stalled'} (exit status {child.exitstatus}, "
                    f"signal {child.signalstatus}) before the expected output; terminal:\n{transcript.getvalue()}",
                    pytrace=False)
    finally:
        child.close()
    assert child.exitstatus == 0
