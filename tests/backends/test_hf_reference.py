"""Our decoder against the HF ``transformers`` reference on small random Llama, Qwen2 and Qwen3 checkpoints.

Covers what the embedded model does not: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), untied LM head,
RoPE scaling (Llama 3.x's "llama3", linear), head_dim different from hidden/heads. Checkpoints are written
by the test in HF safetensors format and loaded through zoomr's own HF-directory loader.
"""


import dataclasses

import numpy as np
import pytest
import torch

from zoomr.backends.torch.model import Decoder
from zoomr.backends.torch.weights import load_hf_dir
from zoomr.kvstore.base import FullKVCache

transformers = pytest.importorskip("transformers")

CASES = {
    "qwen2-bias-untied": dict(model_type="qwen2", tie_word_embeddings=False, rope_theta=10000.0),
    "llama-llama3-scaling": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-scaling": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # Qwen3's own RoPE base; head_dim 24 where hidden / heads is 16, as Qwen3 configs give it
    "qwen3-qk-norm": dict(model_type="qwen3", tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3-qk-norm-tied": dict(model_type="qwen3", tie_word_embeddings=True, rope_theta=10000.0),
}
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_random_checkpoint(path, model_type, **extra):
    cfg = getattr(transformers, CONFIGS[model_type])(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[model_type])(cfg)
    # HF initialises biases to zero, norms to one and projections at std 0.02, under which attention is near
    # uniform and RoPE hardly moves a logit: make each of them matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.3)
            elif ".self_attn." in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref = write_random_checkpoint(tmp_path, **CASES[case])
    cfg, tensors, _ = load_hf_dir(tmp_path)
    model_type = CASES[case]["model_type"]
    assert cfg.arch == model_type and cfg.head_dim == 24 and cfg.attn_bias == (model_type == "qwen2")
    ids = list(np.random.default_rng(1).integers(0, 97, size=150))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float().numpy()
    got = logits(cfg, tensors, ids)
    assert float(np.abs(got - want).max()) <= 1e-4
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # what the case is about moves the logits far beyond that tolerance: the test would catch its absence
    if cfg.rope_scaling:  # 150 positions, past original_max_position_embeddings 64 (llama3)
        plain = logits(dataclasses.replace(cfg, rope_scaling=None), tensors, ids)
        assert float(np.abs(plain - want).max()) > 0.05
    if cfg.qk_norm:
        unit = {k: np.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in tensors.items()}
        assert float(np.abs(logits(cfg, unit, ids) - want).max()) > 0.05


def logits(cfg, tensors, ids: list[int]) -> np.ndarray:
    """Our decoder's fp32 [T, vocab] logits, every position of ``ids`` in one prefill."""
    dec = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    return dec.forward(torch.tensor(ids), torch.arange(len(ids)), cache, all_logits=True).numpy()


def test_qwen3_config_round_trips_through_to_hf(tmp_path):
    """``ModelConfig.to_hf`` writes a config transformers builds a Qwen3ForCausalLM from (what ``zoomr finetune``
    does), with the head size, no biases and the RoPE base kept; zoomr reads it back unchanged."""
    from zoomr.backends.torch.config import ModelConfig

    write_random_checkpoint(tmp_path, **CASES["qwen3-qk-norm"])
    cfg, _, _ = load_hf_dir(tmp_path)
    hf = cfg.to_hf()
    tcfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **{k: v for k, v in hf.items() if v is not None})
    model = transformers.AutoModelForCausalLM.from_config(tcfg)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (24,) and attn.q_proj.bias is None and attn.o_proj.bias is None
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_qwen3_config_without_head_dim_takes_transformers_default(tmp_path):
    """transformers' Qwen3Config defaults ``head_dim`` to 128 whatever hidden / heads is (here 16): a config.json
    without the key means 128-wide heads, for transformers and for zoomr."""
    import json

    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert transformers.AutoConfig.from_pretrained(tmp_path).head_dim == 128
    ours, tensors, _ = load_hf_dir(tmp_path)
    assert ours.head_dim == 128
    ids = list(range(1, 40))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits(ours, tensors, ids), want, atol=1e-4, rtol=1e-4)
