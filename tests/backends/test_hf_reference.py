"""Our decoder against the HF ``transformers`` reference on small random Llama and Qwen2 checkpoints.

Covers what the embedded model does not: q/k/v bias (Qwen2), untied LM head, RoPE scaling, head_dim
different from hidden/heads. Checkpoints are written by the test in HF safetensors format and loaded
through zoomr's own HF-directory loader.
"""


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
}


def write_random_checkpoint(path, model_type, **extra):
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    cfg = cfg_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                  rms_norm_eps=1e-5, **extra)
    torch.manual_seed(0)
    model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[model_type](cfg)
    with torch.no_grad():  # HF initialises biases to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref = write_random_checkpoint(tmp_path, **CASES[case])
    cfg, tensors, _ = load_hf_dir(tmp_path)
    assert cfg.head_dim == 24 and cfg.attn_bias == (CASES[case]["model_type"] == "qwen2")
    ids = list(np.random.default_rng(1).integers(0, 97, size=150))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float().numpy()
    dec = Decoder(cfg, tensors, torch.device("cpu"), torch.float32)
    cache = FullKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    got = dec.forward(torch.tensor(ids), torch.arange(len(ids)), cache, all_logits=True).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
