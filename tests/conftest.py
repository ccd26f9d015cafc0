"""Shared fixtures: the embedded model (offline), loaded once per test session."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ZOOMR_DATA", None)  # data set names resolve to the copies shipped in the package

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    from backends.models import embedded_gguf

    return embedded_gguf()


@pytest.fixture(scope="session")
def torch_backend(embedded_path):
    """The torch backend on the embedded GGUF, fp32 on CPU (exact enough for parity checks)."""
    from backends.models import resolve_model
    from backends.torch.engine import TorchBackend

    return TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=2048)


@pytest.fixture(scope="session")
def gguf_weights(embedded_path):
    """(config, float32 tensors) of the embedded model as the GGUF loader produces them."""
    from backends.torch.weights import load_gguf

    cfg, tensors, _ = load_gguf(embedded_path)
    return cfg, tensors


def zoomr_cmd() -> list[str]:
    """How tests run the CLI as a user would: the installed console script's module, this interpreter."""
    return [sys.executable, "-m", "zoomr_cli"]


def sigint_default() -> None:
    """``preexec_fn`` for children that tests Ctrl-C on: a shell that starts the suite in the background
    (``cmd &``) makes SIGINT ignored, children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
