"""The suite's wait helper: a child that dies fails the wait at once, with its stderr."""

import subprocess
import sys
import time

import pytest

from conftest import wait_for


def test_a_child_that_exits_fails_the_wait_at_once_with_its_stderr():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('no model here'); sys.exit(3)"],
                         stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="(?s)exited with 3 before a record.*no model here"):
        wait_for(lambda: False, p, 600, "a record")
    assert time.monotonic() - start < 60  # not the 600 s timeout


def test_a_stalled_child_is_killed_at_the_timeout():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stderr=subprocess.PIPE, text=True)
    with pytest.raises(pytest.fail.Exception, match="still no first record after 1 s: child killed"):
        wait_for(lambda: False, p, 1, "first record")
    assert p.poll() is not None


def test_the_condition_ends_the_wait():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: True, p, 1, "anything")
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
