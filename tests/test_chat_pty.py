"""``zoomr chat`` in a real pseudo-terminal: question in, streamed answer out, /stats, /exit."""

import os
import sys

import pexpect

from conftest import ROOT


def test_chat_session_in_a_pty():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "zoomr_cli", "chat", "--no-live", "-n", "24", "--temp", "0"],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=240)
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
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
