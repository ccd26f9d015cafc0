"""A HF-style directory (safetensors + tokenizer.json + tokenizer_config.json) made from the embedded model
runs through the whole CLI, by path and as a cached hub id, and matches the GGUF path token for token."""

import json
import os
import subprocess

import pytest

from zoomr.backends.torch.weights import write_hf_dir
from conftest import ROOT, write_hf_tokenizer, zoomr_cmd


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gguf_weights, embedded_path):
    out = tmp_path_factory.mktemp("smollm2-hf")
    write_hf_dir(*gguf_weights, out)
    write_hf_tokenizer(embedded_path, out)
    return out


@pytest.mark.slow
def test_hf_tokenizer_matches_llamacpp(hf_dir, torch_backend):
    from zoomr.backends.tokenizer import HFTokenizer

    hf = HFTokenizer(hf_dir)
    text = "<|im_start|>user\nNatalia sold 48 clips in April, then half as many in May. Total?<|im_end|>\n"
    assert hf.encode(text) == torch_backend.tokenizer.encode(text)
    assert hf.eos_ids == {2} and hf.bos_id == 1 and hf.chat_template == torch_backend.tokenizer.chat_template


def run_solve(model, tmp_path, name, env_extra=None):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    r = subprocess.run(zoomr_cmd() + ["solve", "examples/problem.txt", "-n", "10", "--dtype", "fp32", "--no-live",
                                      "--json", str(out)] + (["-m", model] if model else []),
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_cli_on_hf_dir_and_hub_cache_match_gguf(hf_dir, tmp_path):
    gguf_run = run_solve(None, tmp_path, "gguf")
    dir_run = run_solve(str(hf_dir), tmp_path, "dir")
    assert dir_run["text"] == gguf_run["text"] and dir_run["prompt_tokens"] == gguf_run["prompt_tokens"]

    # the same files as a hub snapshot in an offline cache: models--owner--name/snapshots/<rev>/
    cache = tmp_path / "hub"
    snap = cache / "models--zoomr-test--smollm2-hf" / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    for f in hf_dir.iterdir():
        os.symlink(f, snap / f.name)
    (cache / "models--zoomr-test--smollm2-hf" / "refs").mkdir()
    (cache / "models--zoomr-test--smollm2-hf" / "refs" / "main").write_text("0123456789abcdef")
    hub_run = run_solve("zoomr-test/smollm2-hf", tmp_path, "hub", {"HF_HUB_CACHE": str(cache)})
    assert hub_run["text"] == gguf_run["text"]


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    r = subprocess.run(zoomr_cmd() + ["solve", "-p", "1+1?", "-m", "nobody/no-such-model", "--no-live"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr


def test_unreachable_hub_says_what_was_tried_and_why_it_failed(tmp_path):
    # online mode, but the hub's address refuses connections: one line naming the three places looked in
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2")
    r = subprocess.run(zoomr_cmd() + ["solve", "-p", "1+1?", "-m", "nobody/no-such-model", "--no-live"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("zoomr: error:")]
    assert len(errors) == 1, r.stderr
    line = errors[0]
    assert "no such local file or directory" in line and "not in the local hub cache" in line, line
    assert "download failed (" in line, line
