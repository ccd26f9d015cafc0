"""``--policy triattention`` and ``zoomr calibrate`` from the command line: calibration on first use (one progress
line, then cached), ahead of time into a file, and the bad inputs: statistics of another RoPE, a corrupt file, a
model the torch backend cannot calibrate. Each bad one is one line and exit 2, and leaves nothing in the cache."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import ENV, ROOT, assert_one_line_error, zoomr_cmd
from zoomr.backends.query_stats import RopeSpec, write_stats
from zoomr.kvstore.triattention import QueryStats

pytestmark = pytest.mark.slow


def run(tmp_path, *args, timeout=600):
    env = {**ENV, "ZOOMR_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(zoomr_cmd() + list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def cached(tmp_path) -> list[str]:
    folder = tmp_path / "cache" / "triattention"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_first_use_calibrates_once_with_a_progress_line_then_reads_the_cache(tmp_path):
    first = run(tmp_path, "solve", "-p", "What is 2 + 3?", "--policy", "triattention", "-n", "4", "--no-live")
    assert first.returncode == 0, first.stderr
    assert "zoomr: triattention: calibrating query statistics of smollm2-135m on 2048 tokens" in first.stderr
    assert "calibrated in" in first.stderr
    assert len(cached(tmp_path)) == 1 and cached(tmp_path)[0].endswith(".safetensors")
    again = run(tmp_path, "solve", "-p", "What is 2 + 3?", "--policy", "triattention", "--backend", "llamacpp",
                "-n", "4", "--no-live")
    assert again.returncode == 0, again.stderr
    assert "calibrating" not in again.stderr   # the same model file: the cached statistics serve llama.cpp too


def test_calibrate_writes_a_file_that_both_backends_take(tmp_path):
    out = tmp_path / "stats.safetensors"
    r = run(tmp_path, "calibrate", "--tokens", "64", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout and out.is_file() and cached(tmp_path) == []
    for backend in ("torch", "llamacpp"):
        s = run(tmp_path, "solve", "-p", "What is 2 + 3?", "--policy", "triattention", "--stats-file", str(out),
                "--backend", backend, "-n", "4", "--no-live", "--json", "-")
        assert s.returncode == 0, s.stderr
        assert json.loads(s.stdout)["kv"]["policy"].startswith("triattention(B=64")
        assert "calibrating" not in s.stderr
    assert cached(tmp_path) == []


def _other_rope_file(path):
    """Statistics shaped like the embedded model's (30 layers × 9 heads, head size 64) under another RoPE base."""
    omega = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    rope = RopeSpec(500000.0, None, 64, 30, 9, 3, omega)
    stats = QueryStats(torch.ones(30, 9, 32, dtype=torch.complex64), torch.ones(30, 9, 32), omega)
    return write_stats(path, stats, rope, model_sha256="0" * 64, model_name="other", tokens=1, text="test")


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_statistics_of_another_rope_are_refused(tmp_path, backend):
    path = _other_rope_file(tmp_path / "other.safetensors")
    r = run(tmp_path, "solve", "-p", "What is 2 + 3?", "--policy", "triattention", "--stats-file", str(path),
            "--backend", backend, "-n", "4", "--no-live")
    assert_one_line_error(r)
    assert "was calibrated for a RoPE and shape of theta 500000" in r.stderr and "this model has theta 100000" in r.stderr
    assert cached(tmp_path) == []


def test_a_corrupt_statistics_file_is_refused(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(b"\x93NUMPY not safetensors at all" * 4)
    r = run(tmp_path, "solve", "-p", "What is 2 + 3?", "--policy", "triattention", "--stats-file", str(path),
            "-n", "4", "--no-live")
    assert_one_line_error(r)
    assert "not a readable TriAttention statistics file" in r.stderr


def test_calibrating_a_model_the_torch_backend_refuses_writes_nothing(tmp_path):
    model = tmp_path / "mamba"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 64}))
    r = run(tmp_path, "calibrate", "-m", str(model))
    assert_one_line_error(r)
    assert "unsupported model_type 'mamba'" in r.stderr
    assert cached(tmp_path) == []
    bad = run(tmp_path, "calibrate", "--tokens", "5")
    assert_one_line_error(bad)
    assert "--tokens must be in [16, 32768]" in bad.stderr
