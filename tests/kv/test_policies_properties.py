"""Invariants of every policy over random long runs (hypothesis).

* positions attended are unique, sorted, inside [0, positions written) and the new token is last;
* the recent window (as of the last selection, + the new token) is always attended (and the prompt, for SumR/ZoomR; the sinks for streaming);
* a budgeted policy never attends more than its ``bound_tokens`` in a decode step (B + slack, or for R-KV,
  which leaves the prompt whole until its first compression, the first multiple of the buffer ≥ P, + 1).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.keydiff import KeyDiffPolicy
from zoomr.kvstore.registry import PolicySpec
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.snapkv import SnapKVPolicy
from zoomr.kvstore.streaming import StreamingPolicy
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy

L, H, HKV, D = 2, 4, 2, 4
PIECES = ["w", " w", ".", ":", "\n", "\n\n", "!", "<|begin_of_summary|>", "<|end_of_summary|>"]


def make(name, budget, window, buffer):
    if name == "streaming":
        return StreamingPolicy(budget, sink=min(4, budget - window), window=window)
    if name == "h2o":
        return H2OPolicy(budget, window)
    if name == "snapkv":
        return SnapKVPolicy(budget, window, buffer=buffer)
    if name == "rkv":
        return RKVPolicy(budget, window, buffer=max(buffer, window))
    if name == "keydiff":
        return KeyDiffPolicy(budget, window, buffer=buffer)
    if name == "sumr":
        return SumRPolicy(window, "auto")
    return ZoomRPolicy(window, 2, 2, "auto")


@pytest.mark.parametrize("name", ["streaming", "h2o", "snapkv", "rkv", "keydiff", "sumr", "zoomr"])
@settings(max_examples=4, deadline=None)
@given(budget=st.integers(4, 24), window_frac=st.floats(0.1, 0.9), buffer=st.integers(1, 24),
       n_prompt=st.integers(1, 40), texts=st.lists(st.sampled_from(PIECES), min_size=60, max_size=160),
       seed=st.integers(0, 2**16))
def test_policy_invariants_over_a_long_run(name, budget, window_frac, buffer, n_prompt, texts, seed):
    window = max(1, min(budget - 1, int(budget * window_frac)))
    policy = make(name, budget, window, buffer)
    cache = PolicyKVCache(policy, L, H, HKV, D, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    start, T = 0, n_prompt
    for i in range(len(texts) + 1):
        for layer in range(L):
            cache.update(layer, torch.randn(H, T, D, generator=g), torch.randn(HKV, T, D, generator=g),
                         torch.randn(HKV, T, D, generator=g))
        cache.end_forward([0] * T, "prompt" if i == 0 else texts[i - 1])
        n = start + T
        for layer in range(L):
            pos = cache.positions(layer)
            assert pos.shape[0] == HKV
            for row in pos.tolist():
                assert row == sorted(set(row)) and 0 <= row[0] and row[-1] == n - 1
                # the window kept at the last selection, plus the token appended since
                recent = set(range(max(0, n - 1 - window), n))
                if name in ("sumr", "zoomr"):
                    recent = set(range(n_prompt)) | (recent - set(range(n_prompt)))
                if name == "streaming":
                    recent |= set(range(min(policy.sink, n)))
                assert recent <= set(row), "window (and prompt/sinks) must stay attended"
            if i > 0 and policy.budget is not None:
                assert pos.shape[1] <= policy.bound_tokens
        start, T = n, 1
    stats = cache.stats()
    assert stats.full_tokens == n and stats.active_tokens <= n and stats.peak_active_tokens <= n


@pytest.mark.parametrize("spec,msg", [
    (PolicySpec("h2o", budget=0), "--budget"),
    (PolicySpec("streaming", budget=8, sink=4, window=8), "smaller than --sink 4 + --window 8"),
    (PolicySpec("streaming", budget=4, sink=4), "no recent window"),
    (PolicySpec("rkv", budget=8), "larger than --window 8"),
    (PolicySpec("snapkv", budget=16, window=16), "--window"),
    (PolicySpec("h2o", budget=16, window=16), "--window"),
    (PolicySpec("zoomr", summaries="bogus"), "--summaries"),
    (PolicySpec("zoomr", topk_per_head=0), "--topk-per-head"),
    (PolicySpec("zoomr", consensus=-1), "--consensus"),
    (PolicySpec("zoomr", window=0), "--window"),
    (PolicySpec("lru"), "--policy"),
])
def test_bad_knobs_raise_one_clear_value_error(spec, msg):
    with pytest.raises(ValueError, match=msg.replace("+", r"\+")):
        spec.build()
