"""llama_decode failures and bad input on the llama.cpp backend: one clear error, consistent state, no hang."""

import subprocess

import numpy as np
import pytest

from zoomr.backends.base import BackendError
from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.models import ModelSource, resolve_model
from conftest import ROOT, zoomr_cmd


@pytest.fixture(scope="module")
def small():
    """Full KV, -c 256, exactly 256 shared cells for two sequences: a fork can exhaust the cache."""
    be = LlamaCppBackend(resolve_model(None), n_ctx=256, threads=1, max_sequences=2, kv_cells=256)
    yield be
    be.close()


def test_no_kv_slot_is_a_backend_error_and_the_sequence_survives(small):
    assert small.kv_cells == 256
    parent = small.new_sequence()
    small.prefill(parent, list(range(1000, 1200)))
    child = small.fork(parent)  # shares the 200 cells
    small.prefill(child, list(range(2000, 2056)))  # 56 private cells: the cache is now full
    before = small.tokens_submitted
    with pytest.raises(BackendError, match="no free KV slot"):
        small.decode(parent, 7)  # the parent is within -c, but llama.cpp has no cell left (return code 1)
    assert small.tokens_submitted == before + 1
    assert len(parent.tokens) == small.cells_held(parent) == 200  # nothing half-written
    small.free(child)
    assert np.isfinite(small.decode(parent, 7)).all()  # room again: decoding resumes
    small.free(parent)


def test_abort_is_a_backend_error_and_rolls_back(small):
    seq = small.new_sequence()
    small.prefill(seq, list(range(1000, 1100)))
    small.set_abort(lambda: True)
    try:
        with pytest.raises(BackendError, match="aborted"):
            small.prefill(seq, list(range(3000, 3100)))  # llama_decode returns 2
    finally:
        small.set_abort(None)
    assert len(seq.tokens) == small.cells_held(seq) == 100
    assert np.isfinite(small.decode(seq, 7)).all()
    small.free(seq)


def test_context_full_and_bad_ids_are_value_errors_before_any_decode(small):
    seq = small.new_sequence()
    small.prefill(seq, list(range(1000, 1250)))
    before = small.tokens_submitted
    with pytest.raises(ValueError, match="context full"):
        small.prefill(seq, list(range(10)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.decode(seq, small.info.n_vocab)
    with pytest.raises(ValueError, match="zero tokens"):
        small.prefill(seq, [])
    assert small.tokens_submitted == before and len(seq.tokens) == 250
    small.free(seq)


def test_zoomr_refuses_to_fork_on_llamacpp():
    """A fork would need its own copy of the store: refused by name, and no sequence id is lost."""
    be = LlamaCppBackend(resolve_model(None), n_ctx=256, threads=1, policy="zoomr", window=32)
    seq = be.new_sequence()
    be.prefill(seq, [1, 2, 3])
    with pytest.raises(ValueError, match="--policy zoomr on --backend llamacpp cannot fork"):
        be.fork(seq)
    be.free(seq)
    be.free(be.new_sequence())   # both ids came back
    be.close()


def test_hf_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a GGUF file"):
        LlamaCppBackend(ModelSource("hf", tmp_path, "x"))


@pytest.mark.parametrize("command", ["solve", "chat"])
@pytest.mark.slow
def test_cli_unsupported_policy_is_one_line_exit_2(command):
    """Refused with the flags, before any model loads: the error is the only line on stderr (it once came
    after "loading model…")."""
    args = ["solve", "-p", "What is 2+3?"] if command == "solve" else ["chat"]
    r = subprocess.run(zoomr_cmd() + args + ["--backend", "llamacpp", "--policy", "nope", "--no-live"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, input="")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("zoomr: error: --policy 'nope' unknown (choose from full, streaming")
