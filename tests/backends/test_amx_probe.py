"""llama.cpp's AMX layouts: the child-process probe, its cache, and the loads that follow its verdict.

On a machine whose llama.cpp build has AMX kernels that fault (a Firecracker guest on a Xeon with AMX), every
llama.cpp test here died with SIGILL before the probe existed; on other machines the probe must cost nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zoomr.backends.llamacpp import amx_probe
from zoomr.backends.llamacpp.runtime import llama_defaults, model_params

needs_amx_build = pytest.mark.skipif(not amx_probe.built_with_amx(), reason="this llama.cpp build has no AMX kernels")


@pytest.fixture(autouse=True)
def fresh_process_verdicts(monkeypatch):
    """Each test starts as a new process would: no verdict found yet in this one."""
    monkeypatch.setattr(amx_probe, "_found", {})


def test_builds_without_amx_kernels_start_no_child(tmp_path, monkeypatch, embedded_path):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path))
    if amx_probe.built_with_amx():
        pytest.skip("this llama.cpp build has AMX kernels")
    assert amx_probe.extra_bufts_ok(embedded_path) is True
    assert amx_probe.known_verdict() is None
    assert not (tmp_path / amx_probe.CACHE_FILE).exists()


@needs_amx_build
def test_verdict_matches_the_child_and_is_cached(tmp_path, monkeypatch, embedded_path):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path))
    child = subprocess.run([sys.executable, "-m", amx_probe.__name__, str(embedded_path)], capture_output=True,
                           text=True, timeout=amx_probe.PROBE_TIMEOUT_S)
    faults = child.returncode < 0
    assert faults or child.returncode == 0, child.stderr[-2000:]
    assert amx_probe.extra_bufts_ok(embedded_path) is (not faults)
    stored = json.loads((tmp_path / amx_probe.CACHE_FILE).read_text())
    assert [v["extra_bufts"] for v in stored.values()] == [not faults]
    # the cached entry is what later processes read: flipped by hand, it is believed (no second child)
    amx_probe._found.clear()
    key = next(iter(stored))
    (tmp_path / amx_probe.CACHE_FILE).write_text(json.dumps({key: {"extra_bufts": faults}}))
    assert amx_probe.extra_bufts_ok(embedded_path) is faults
    assert model_params(embedded_path).use_extra_bufts is faults


@needs_amx_build
def test_a_model_the_child_cannot_load_proves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path))
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert amx_probe.extra_bufts_ok(bad) is True   # the real load reports its own error
    assert amx_probe.known_verdict() is None


@needs_amx_build
def test_model_line_says_when_amx_layouts_are_off(tmp_path, monkeypatch, embedded_path):
    from zoomr.backends.llamacpp.engine import LlamaCppBackend
    from zoomr.backends.models import resolve_model

    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path))
    (tmp_path / amx_probe.CACHE_FILE).write_text(json.dumps({amx_probe._key(): {"extra_bufts": False}}))
    backend = LlamaCppBackend(resolve_model(None), n_ctx=256, threads=1, max_sequences=1)
    try:
        assert "AMX layouts off" in backend.describe()
        seq = backend.new_sequence()
        assert backend.prefill(seq, list(range(100, 100 + amx_probe.PROBE_TOKENS))).shape[-1] == backend.info.n_vocab
    finally:
        backend.close()


@needs_amx_build
def test_the_verdict_holds_where_the_cache_cannot_be_written(tmp_path, monkeypatch, embedded_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ZOOMR_CACHE", str(blocker / "cache"))   # under a regular file: never writable
    child = subprocess.run([sys.executable, "-m", amx_probe.__name__, str(embedded_path)], capture_output=True,
                           text=True, timeout=amx_probe.PROBE_TIMEOUT_S)
    faults = child.returncode < 0
    assert amx_probe.extra_bufts_ok(embedded_path) is (not faults)
    # the model line reads known_verdict(): it must say what this process found, cache or not
    assert amx_probe.known_verdict() is ((not faults) if faults or amx_probe._USED in child.stdout else None)
    assert not (blocker / "cache").exists()


def test_llama_defaults_applies_the_verdict_and_restores_the_bindings(embedded_path):
    import llama_cpp.llama_cpp as bindings

    before = bindings.llama_model_default_params
    with llama_defaults(embedded_path):
        inside = bindings.llama_model_default_params()
    assert bindings.llama_model_default_params is before
    if hasattr(inside, "use_extra_bufts"):
        assert inside.use_extra_bufts == model_params(embedded_path).use_extra_bufts
