"""TriAttention's calibration and its statistics files: what calibration measures (the pre-RoPE query after a Qwen3
model's q_norm, recomputed here from the weights), the file's round trip and its refusals (corrupt, another RoPE),
atomic writes, the per-model cache and the model hash it is keyed by."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gguf_tiny import N_TOKENS, write_tiny_gguf
from zoomr.backends.fingerprint import model_sha256
from zoomr.backends.models import ModelSource
from zoomr.backends.query_stats import (RopeSpec, StatsFileError, cached_path, query_stats, read_stats,
                                        write_stats)
from zoomr.backends.torch.calibrate import calibrate, gguf_rope_spec, rope_spec
from zoomr.backends.torch.engine import TorchBackend
from zoomr.backends.torch.weights import load_gguf
from zoomr.kvstore.triattention import QueryStats, complex_pairs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory, embedded_path):
    path = write_tiny_gguf(tmp_path_factory.mktemp("tri") / f"{request.param}.gguf", embedded_path, arch=request.param,
                           attn_std=0.4)
    backend = TorchBackend(ModelSource("gguf", path, path.name), device="cpu", dtype="fp32", quant="none", n_ctx=256)
    return request.param, path, backend


IDS = [int(x) for x in np.random.default_rng(0).integers(3, N_TOKENS, 60)]


def test_calibration_measures_the_pre_rope_query_after_q_norm(tiny):
    """Layer 0's statistics recomputed from the weights: embedding → RMSNorm → q_proj → (Qwen3) q_norm, no RoPE."""
    arch, path, backend = tiny
    stats, used = calibrate(backend, ids=IDS)
    assert used == len(IDS) and stats.shape == (2, backend.cfg.n_heads, backend.cfg.head_dim // 2)
    cfg, w, _ = load_gguf(path)
    x = torch.from_numpy(w["model.embed_tokens.weight"][IDS])
    h = F.rms_norm(x, (cfg.hidden,), torch.from_numpy(w["model.layers.0.input_layernorm.weight"]), cfg.rms_eps)
    q = (h @ torch.from_numpy(w["model.layers.0.self_attn.q_proj.weight"]).T).view(len(IDS), cfg.n_heads, cfg.head_dim)
    raw = complex_pairs(q.double(), "half").mean(dim=0)
    if arch == "qwen3":
        q = F.rms_norm(q, (cfg.head_dim,), torch.from_numpy(w["model.layers.0.self_attn.q_norm.weight"]), cfg.rms_eps)
        assert not torch.allclose(raw.to(torch.complex64), stats.q_mean[0], atol=1e-2)   # the norm matters here
    pre = complex_pairs(q.double(), "half")
    assert torch.allclose(stats.q_mean[0], pre.mean(dim=0).to(torch.complex64), atol=1e-4)
    assert torch.allclose(stats.q_abs_mean[0], pre.abs().mean(dim=0).float(), atol=1e-4)


def test_chunked_calibration_is_one_forward_pass(tiny):
    _, _, backend = tiny
    whole, _ = calibrate(backend, ids=IDS, chunk=512)
    parts, _ = calibrate(backend, ids=IDS, chunk=7)
    assert torch.allclose(whole.q_mean, parts.q_mean, atol=1e-5)
    assert torch.allclose(whole.q_abs_mean, parts.q_abs_mean, atol=1e-5)


def test_the_file_rope_is_the_loaded_model_rope(tiny):
    _, path, backend = tiny
    a, b = gguf_rope_spec(path), rope_spec(backend)
    assert a.words() == b.words() and torch.allclose(a.omega, b.omega, rtol=0, atol=0)


def _spec(**change) -> RopeSpec:
    base = dict(theta=10000.0, scaling=None, head_dim=8, n_layers=2, n_heads=4, n_kv_heads=2,
                omega=1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    base.update(change)
    return RopeSpec(**base)


def _stats(seed: int = 0) -> QueryStats:
    g = torch.Generator().manual_seed(seed)
    q = torch.complex(torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 4, generator=g))
    return QueryStats(q, q.abs() + 0.5, _spec().omega)


def test_a_statistics_file_round_trips_and_records_what_it_was_taken_under(tmp_path):
    path = write_stats(tmp_path / "s.safetensors", _stats(), _spec(), model_sha256="ab" * 32, model_name="m",
                       tokens=123, text="t")
    back = read_stats(path, _spec())
    assert torch.equal(back.q_mean, _stats().q_mean) and torch.equal(back.q_abs_mean, _stats().q_abs_mean)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["model_sha256"] == "ab" * 32 and meta["tokens"] == "123" and meta["rope_theta"] == "10000.0"
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]   # no temporary left


@pytest.mark.parametrize("change", [dict(theta=500000.0), dict(scaling={"rope_type": "linear", "factor": 2.0}),
                                    dict(n_layers=3), dict(omega=_spec().omega * 1.001)])
def test_statistics_of_another_rope_or_shape_are_refused(tmp_path, change):
    path = write_stats(tmp_path / "s.safetensors", _stats(), _spec(), model_sha256="0" * 64, model_name="m",
                       tokens=1, text="t")
    with pytest.raises(StatsFileError, match="was calibrated for a RoPE and shape of theta 10000") as e:
        read_stats(path, _spec(**change))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other tensors"])
def test_a_corrupt_statistics_file_is_one_clear_error(tmp_path, damage):
    path = write_stats(tmp_path / "s.safetensors", _stats(), _spec(), model_sha256="0" * 64, model_name="m",
                       tokens=1, text="t")
    if damage == "garbage":
        path.write_bytes(os.urandom(300))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    else:
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "zoomr-triattention-query-stats"})
    with pytest.raises(StatsFileError, match="not a readable TriAttention statistics file") as e:
        read_stats(path, _spec())
    assert "\n" not in str(e.value)
    with pytest.raises(StatsFileError, match="no such"):
        read_stats(tmp_path / "missing.safetensors", _spec())


def test_a_failed_write_leaves_nothing_half_written(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()   # os.replace onto a directory fails after the data was written
    with pytest.raises(OSError):
        write_stats(target, _stats(), _spec(), model_sha256="0" * 64, model_name="m", tokens=1, text="t")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and not any(target.iterdir())


def test_the_cache_calibrates_once_per_model_and_names_the_fix_for_a_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not really a model, but bytes to hash")
    runs = []

    def run():
        runs.append(1)
        return _stats(), 5, "text"

    first = query_stats(model, "m", _spec(), run)
    second = query_stats(model, "m", _spec(), run)
    assert len(runs) == 1 and torch.equal(first.q_mean, second.q_mean)
    entry = cached_path(hashlib.sha256(model.read_bytes()).hexdigest())
    assert entry.is_file()
    entry.write_bytes(b"\x00" * 10)
    with pytest.raises(StatsFileError, match="rebuild it with zoomr calibrate -m m"):
        query_stats(model, "m", _spec(), run)
    given = write_stats(tmp_path / "given.safetensors", _stats(1), _spec(), model_sha256="0" * 64, model_name="m",
                        tokens=1, text="t")
    assert torch.equal(query_stats(model, "m", _spec(), run, stats_file=str(given)).q_mean, _stats(1).q_mean)
    assert len(runs) == 1


def test_the_model_hash_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOOMR_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    assert model_sha256(model) == hashlib.sha256(b"one").hexdigest()
    assert (tmp_path / "cache" / "model_sha256.json").is_file()
    model.write_bytes(b"two!")   # another size: hashed again
    assert model_sha256(model) == hashlib.sha256(b"two!").hexdigest()
