"""Shared fixtures: the embedded model (offline), loaded once per test session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
# One compute thread for torch here and in every child (export OMP_NUM_THREADS to choose): on a shared
# 2-core machine two spinning OpenMP threads run a bench cell about four times slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ZOOMR_DATA", None)  # data set names resolve to the copies shipped in the package

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    from zoomr.backends.models import embedded_gguf

    return embedded_gguf()


@pytest.fixture(scope="session")
def torch_backend(embedded_path):
    """The torch backend on the embedded GGUF, fp32 on CPU (exact enough for parity checks)."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend

    return TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=2048)


@pytest.fixture(scope="session")
def gguf_weights(embedded_path):
    """(config, float32 tensors) of the embedded model as the GGUF loader produces them."""
    from zoomr.backends.torch.weights import load_gguf

    cfg, tensors, _ = load_gguf(embedded_path)
    return cfg, tensors


def zoomr_cmd() -> list[str]:
    """How tests run the CLI as a user would: the installed console script's module, this interpreter."""
    return [sys.executable, "-m", "zoomr"]


def sigint_default() -> None:
    """``preexec_fn`` for children that tests Ctrl-C on: a shell that starts the suite in the background
    (``cmd &``) makes SIGINT ignored, children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(pred, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``pred()`` (every 0.2 s) until it holds, for a child that must still be running meanwhile.

    A child that exits first fails the test at once with its exit code and stderr (when piped), instead of
    leaving the test to sit out ``timeout``; past ``timeout`` (seconds) the child is killed and the test fails.
    ``what`` names the condition in the failure message.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else "(stderr not piped)"
            pytest.fail(f"child exited with {proc.returncode} before {what}; stderr:\n{err}", pytrace=False)
        if time.monotonic() > deadline:
            proc.kill()
            err = proc.communicate()[1] if proc.stderr is not None else "(stderr not piped)"
            pytest.fail(f"still no {what} after {timeout:.0f} s: child killed; stderr:\n{err}", pytrace=False)
        time.sleep(0.2)


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "ZOOMR_DEBUG": ""}


def zoomr(*args, stdin: str | None = None, timeout: int = 300):
    return subprocess.run(zoomr_cmd() + list(args), input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


def assert_one_line_error(r, code=2):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert lines and lines[-1].startswith("zoomr: error:"), r.stderr
    assert "Traceback" not in r.stderr
