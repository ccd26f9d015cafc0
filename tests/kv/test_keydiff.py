"""KeyDiff (the 8th policy): keys least like their head's anchor are kept, from the keys alone, per KV head."""

import pytest
import torch

from zoomr.kvstore.keydiff import KeyDiffPolicy, key_diversity
from zoomr.kvstore.policy import LayerView
from zoomr.kvstore.registry import PolicySpec, policy_info


def test_the_score_is_minus_the_cosine_to_the_mean_direction():
    keys = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [1.0, 0.1], [0.0, 3.0]]])   # [Hkv 1, N 4, d 2]
    score = key_diversity(keys)
    assert score.shape == (1, 4) and score.dtype == torch.float32
    # the three keys along x make the anchor lean to x: the y key is the one unlike the others
    assert score[0].argmax() == 3 and score[0, 0] == score[0, 1]   # norm does not matter, direction does
    unit = torch.nn.functional.normalize(keys, dim=-1)
    anchor = torch.nn.functional.normalize(unit.mean(1), dim=-1)
    assert torch.allclose(score[0], -(unit[0] @ anchor[0]))


def _view(keys: torch.Tensor) -> LayerView:
    hkv, n, _ = keys.shape
    pos = torch.arange(n).expand(hkv, n)
    return LayerView(0, torch.zeros(2 * hkv, 1, keys.shape[-1]), keys, pos, 1, n - 1)


def test_it_waits_for_the_buffer_then_keeps_the_window_and_the_most_diverse_keys_per_head():
    torch.manual_seed(0)
    policy = KeyDiffPolicy(budget=8, window=2, buffer=4)
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    keys = (base + 0.01 * torch.randn(2, 12, 4))                 # 2 KV heads, 12 positions, nearly alike
    assert policy.observe(_view(keys[:, :11])) is None           # B + buffer = 12 not reached
    keys[0, [1, 4, 6], :] = torch.tensor([0.0, 1.0, 0.0, 0.0])   # head 0's outliers
    keys[1, [0, 3, 7], :] = torch.tensor([0.0, 0.0, -1.0, 0.0])  # head 1's, elsewhere
    kept = policy.observe(_view(keys))
    assert kept.shape == (2, 8) and kept.dtype == torch.int64
    assert {1, 4, 6, 10, 11} <= set(kept[0].tolist()) and {0, 3, 7, 10, 11} <= set(kept[1].tolist())
    assert torch.equal(kept, kept.sort(dim=1).values)


def test_bad_knobs_are_refused_and_it_needs_no_attention_scores():
    with pytest.raises(ValueError, match="--window must be in"):
        KeyDiffPolicy(budget=8, window=8)
    with pytest.raises(ValueError, match="--budget must be at least 2"):
        KeyDiffPolicy(budget=1)
    info = policy_info("keydiff")
    assert not info.needs_scores and info.budgeted and info.evicts and info.backends == ("torch", "llamacpp")
    policy = PolicySpec("keydiff", 32).build()
    assert policy.describe() == "keydiff(B=32, window=8, buffer=128)" and policy.bound_tokens == 160
