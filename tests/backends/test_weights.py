"""Weight loading: GGUF (dequantized) and HF safetensors give the same model."""

import numpy as np
import pytest
import torch

from zoomr.backends.torch.model import Decoder
from zoomr.backends.torch.weights import ModelLoadError, load_gguf, load_hf_dir, unpermute_qk, write_hf_dir
from zoomr.kvstore.base import FullKVCache


def run(cfg, tensors, ids):
    m = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    return m.forward(torch.tensor(ids), torch.arange(len(ids)), cache, all_logits=True).numpy()


def test_safetensors_dir_gives_gguf_logits(gguf_weights, tmp_path):
    cfg, tensors = gguf_weights
    write_hf_dir(cfg, tensors, tmp_path / "hf")
    cfg2, tensors2, _ = load_hf_dir(tmp_path / "hf")
    assert cfg2.n_layers == cfg.n_layers and cfg2.tied_embeddings and cfg2.rope_theta == cfg.rope_theta
    ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2]
    np.testing.assert_allclose(run(cfg2, tensors2, ids), run(cfg, tensors, ids), atol=1e-5, rtol=0)


def test_unpermute_inverts_llamacpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3 * 8, 5))
    # llama.cpp's converter: per head, rows (2, d/2) -> (d/2, 2)
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_qk(permuted, 3), w)


def test_truncated_gguf_is_a_clear_error(embedded_path, tmp_path):
    bad = tmp_path / "half.gguf"
    with open(embedded_path, "rb") as f:
        bad.write_bytes(f.read(4 << 20))
    with pytest.raises(ModelLoadError):
        load_gguf(bad)


def test_random_bytes_are_not_a_gguf(tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError):
        load_gguf(bad)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError):
        load_hf_dir(tmp_path)
