"""``zoomr chat`` in a real pseudo-terminal: question in, streamed answer out, /stats, /exit."""

import contextlib
import io
import os
import sys

import pexpect
import pytest

from conftest import ROOT, sigint_default


def _fail(child, transcript: io.StringIO, e: Exception) -> None:
    """End the test with what the terminal showed: the chat exited or stalled before the expected output."""
    child.close()
    pytest.fail(f"chat {'exited' if isinstance(e, pexpect.EOF) else 'stalled'} (exit status {child.exitstatus}, "
                f"signal {child.signalstatus}) before the expected output; terminal:\n{transcript.getvalue()}",
                pytrace=False)


@contextlib.contextmanager
def chat_session(*args: str):
    """A ``zoomr chat`` child in a pseudo-terminal; /exit on leaving, and it must exit 0.

    Every expect returns at once (pexpect.EOF) when the child exits: no wait on a dead chat.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    transcript = io.StringIO()
    child = pexpect.spawn(sys.executable, ["-m", "zoomr", "chat", "--no-live", *args], cwd=str(ROOT), env=env,
                          encoding="utf-8", timeout=240, preexec_fn=sigint_default)
    child.logfile_read = transcript
    try:
        yield child
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    except (pexpect.EOF, pexpect.TIMEOUT) as e:
        _fail(child, transcript, e)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_chat_session_in_a_pty():
    # --dtype fp32: the 135M model's greedy answer to this question depends on the path's rounding (fp32 and
    # int4 say Paris; llama.cpp itself and --quant ggml, which rounds as it does, list French words instead)
    with chat_session("-n", "400", "--temp", "0", "--dtype", "fp32") as child:
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


LEFT, UP = "\x1b[D", "\x1b[A"  # what a terminal sends for the arrow keys


@pytest.mark.slow
def test_chat_edits_lines_recalls_history_and_resets_stats():
    """Arrow keys edit the line the model gets (readline), Up recalls it, /stats counts and /reset zeroes them.

    The model's prompt length tells what it received: "abd", Left, "c" must prefill exactly as many tokens as
    "abcd" typed straight (the raw escape bytes would add tokens).
    """
    with chat_session("-n", "4", "--temp", "0") as child:
        _edit_recall_reset(child)


def _edit_recall_reset(child) -> None:
    def turn(keys: str) -> tuple[int, int, int]:
        """Send one line, then /stats: (last prefill tokens, turns, conversation prefill tokens)."""
        child.expect_exact("> ")
        child.send(keys + "\r")
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"stats: prefill (\d+) tok @.*conversation: turns (\d+), prefill (\d+) tok")
        return tuple(int(g) for g in child.match.groups())

    def reset() -> None:
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("conversation reset")

    edited = turn("abd" + LEFT + "c")
    reset()
    assert turn("") == (0, 0, 0)        # /reset zeroed the counters (an empty line is no turn)
    # history going back: /stats, /reset, /stats, "abcd" (empty lines are not kept)
    recalled = turn(UP * 4)
    reset()
    typed = turn("abcd")
    assert edited == recalled == typed and typed[1] == 1 and typed[0] == typed[2]
    child.expect_exact("> ")
    child.sendline("/help")
    for command in ("/help", "/stats", "/reset", "/exit"):
        child.expect_exact(command)
    child.expect("editing: arrow keys")
