import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoomr.backends.sampling import Sampler, SamplingParams


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=60), st.integers(0, 10),
       st.floats(0.05, 1.0), st.floats(0.1, 2.0), st.integers(0, 2**31))
def test_filtered_candidates_are_top_tokens(vals, k, p, temp, seed):
    logits = np.array(vals, dtype=np.float32)
    s = Sampler(SamplingParams(temperature=temp, top_k=k, top_p=p, seed=seed))
    ids, probs = s.probs(logits)
    assert abs(probs.sum() - 1) < 1e-9
    if k:
        assert len(ids) <= k
    # every kept token is at least as likely as every dropped one
    dropped = np.setdiff1d(np.arange(len(logits)), ids)
    if len(dropped):
        assert logits[ids].min() >= logits[dropped].max()
    assert s.sample(logits) in set(ids.tolist())


def test_same_seed_same_tokens():
    rng = np.random.default_rng(1)
    logits = [rng.normal(size=100).astype(np.float32) for _ in range(20)]
    a = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7))
    assert [a.sample(x) for x in logits] == [b.sample(x) for x in logits]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(temperature=float("nan"))])
def test_invalid_values_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()
