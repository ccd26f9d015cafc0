"""benchmarks/gpu_check.py has never had a GPU to run on; its dry run on the CPU (--device cpu --shape tiny)
runs every part of it but the CUDA calls, so a lent GPU's few minutes are not lost to a bug in the script."""

import json
import subprocess
import sys

import pytest
from conftest import ENV, ROOT


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--shape",
                        "tiny", "--ctx", "2400", "--decode", "17", "--batches", "1,3", "--steps", "60",
                        "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert set(report["sparse_vs_dense"]) == {"streaming", "h2o", "snapkv", "rkv", "zoomr"}
    rows = {(row["kind"], row["batch"]): row for row in report["decode"]}
    assert set(rows) == {(k, b) for k in ("full-gpu", "full-offloaded", "zoomr", "rkv") for b in (1, 3)}
    for (kind, batch), row in rows.items():
        assert row["full_tokens"] == 2400 and row["tok_s"] > 0, row
        if kind.startswith("full"):
            assert row["active_tokens"] == 2400
        else:   # both evict: zoomr keeps prompt, window and zoomed segments; rkv its budget plus a buffer
            assert row["active_tokens"] < 2400, row
    assert set(report["targets"]) == {"1", "3"} and report["targets"]["3"]["zoomr_vs_offloaded_tok_s"] > 0
    # with no device KV on the CPU the ratio is undefined, and the summary says so instead of "None×"
    assert report["targets"]["3"]["full_gpu_vs_zoomr_device_kv"] is None
    assert "None×" not in r.stdout and "the KV ratio is undefined" in r.stdout
    zoomr = rows[("zoomr", 3)]
    assert zoomr["segments"] >= 2 and zoomr["recomputes"] >= 1 and zoomr["measured_MS"] > 1


def test_gpu_check_without_cuda_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        return   # the check would run for minutes here; the dry run above covers the script
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                       text=True, cwd=tmp_path, env=ENV, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "gpu_check: no CUDA device visible to torch"
