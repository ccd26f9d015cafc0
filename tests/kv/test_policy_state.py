"""Every byte of policy state counted: H2O's scores, ZoomR's mean keys, the queries SnapKV, R-KV and ZoomR keep,
reported as ``policy_state_bytes`` and added to ``device_kv_bytes`` and the saving's denominator."""

import pytest

from policy_drive import D, H, L, drive
from zoomr.backends.base import KVMeter
from zoomr.backends.llamacpp.policies import make_policy
from zoomr.kvstore.h2o import SCORE_GROWTH, H2OPolicy
from zoomr.kvstore.registry import PolicySpec
from zoomr.kvstore.stats import storage_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# text that closes a paragraph segment every few tokens, so SumR and ZoomR hold summaries and mean keys
TEXTS = ["step", " one", ".\n\n", "next", " two", ".\n\n", "then", " three", ".\n\n"] * 8


def test_h2o_at_16k_positions_counts_its_scores_twice_its_attended_kv():
    """The issue's case: fp32, head size 64, B = 64, 16K positions: the scores weigh N/(128·B) ≈ 2× the K/V
    H2O attends, and the saving drops by that much."""
    n, budget = 16384, 64
    policy = H2OPolicy(budget)
    cache, *_ = drive(policy, [" "] * 4, n - 4, shape=(1, 1, 1, 64))   # one 16K prefill, then four decodes
    s = cache.stats()
    scores = sum(t.nbytes for t in policy.score.values())
    assert s.policy_state_bytes == policy.state_bytes() == scores
    capacity = scores // 4
    assert n <= capacity <= n + max(SCORE_GROWTH, n // 8)     # grown by an eighth, not doubled
    assert s.active_tokens == budget + 1
    ratio = s.policy_state_bytes / s.active_bytes              # active: B + 1 positions of fp32 K and V
    assert n / (128 * (budget + 1)) <= ratio <= 1.13 * n / (128 * (budget + 1))
    assert s.saving == pytest.approx(s.mean_full_bytes / (s.mean_active_bytes + s.mean_policy_state_bytes))
    assert s.saving < s.mean_full_bytes / s.mean_active_bytes / 2.9   # ≈ 3× less than the K/V alone claims
    assert s.saving_peak == pytest.approx(s.full_bytes / (s.peak_active_bytes + s.policy_state_bytes))
    assert s.device_kv_bytes >= s.active_bytes + s.policy_state_bytes
    d = s.as_dict()
    assert d["policy_state_bytes"] == scores and d["mean_policy_state_bytes"] == scores


@pytest.mark.parametrize("name,knobs", [("full", {}), ("streaming", {"budget": 16}),
                                        ("sumr", {"window": 8, "segment_tokens": 6}),
                                        ("h2o", {"budget": 16}), ("snapkv", {"budget": 16}),
                                        ("rkv", {"budget": 16}), ("zoomr", {"window": 8, "segment_tokens": 6})])
def test_each_policy_reports_the_tensors_it_keeps(name, knobs):
    policy = PolicySpec(name, **knobs).build()
    cache, *_ = drive(policy, TEXTS, 40)
    s = cache.stats()
    now = policy.state_bytes()
    assert now == storage_bytes(policy.state_tensors())
    assert s.policy_state_bytes >= now and s.mean_policy_state_bytes <= s.policy_state_bytes
    if name in ("full", "streaming", "sumr"):
        assert s.policy_state_bytes == s.mean_policy_state_bytes == 0
    elif name == "h2o":
        assert now == sum(t.nbytes for t in policy.score.values()) >= L * 2 * (40 + len(TEXTS)) * 4
    elif name in ("snapkv", "rkv"):
        # the window's queries only (each a copy: a view would hold the whole stream's q), < 2 windows a layer
        w = policy.window
        assert L * w * H * D * 4 <= now < L * 2 * w * H * D * 4
    else:
        segments = len(policy.tracker.segments)
        assert segments >= 5 and policy.mean_keys.shape[2] == segments
        assert now == policy.mean_keys.nbytes + L * H * D * 4   # mean keys + one [H, d] query a layer


def test_zoomr_keeps_the_newest_query_not_the_prefills():
    """After a 300-token prefill ZoomR holds one [H, d] query per layer, not a view of the prompt's queries."""
    policy = PolicySpec("zoomr").build()
    cache, *_ = drive(policy, [], 300)
    assert policy.state_bytes() == cache.stats().policy_state_bytes == L * H * D * 4


def test_meter_adds_state_to_the_device_peak_and_averages_it_over_decode_steps():
    m = KVMeter(token_bytes=10)
    m.step(4, 40, 4, True, device_bytes=100, state_bytes=50)     # prompt: peaks only
    m.step(5, 50, 5, False, device_bytes=100, state_bytes=10)
    m.step(6, 60, 6, False, device_bytes=120, state_bytes=30)
    s = m.stats(6, 6, 60)
    assert s.device_kv_bytes == 150 and s.policy_state_bytes == 50 and s.mean_policy_state_bytes == 20
    assert s.saving == pytest.approx(55 / (55 + 20))


def test_llamacpp_policies_report_no_state():
    """llama.cpp's policies keep positions in host lists: 0, so its records carry the same fields."""
    for name, knobs in [("full", {}), ("streaming", {"budget": 16}), ("sumr", {"window": 8})]:
        assert make_policy(name, 256, **knobs)().state_bytes() == 0
