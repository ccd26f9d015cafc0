"""``zoomr chat`` in a real pseudo-terminal: question in, streamed answer out, /stats, /exit."""

import os
import sys

import pexpect

from conftest import ROOT, sigint_default


def test_chat_session_in_a_pty():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "zoomr_cli", "chat", "--no-live", "-n", "400", "--temp", "0"],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=240,
                          preexec_fn=sigint_default)
    try:
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
    finally:
        child.close()
    assert child.exitstatus == 0
