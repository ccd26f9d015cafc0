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


def test_draws_follow_numpy_choice_over_the_filtered_candidates():
    """The stream is numpy's: one uniform per token, inverse CDF over the candidates in descending order."""
    rng = np.random.default_rng(3)
    logits = [rng.normal(size=300).astype(np.float32) * 2 for _ in range(30)]
    s = Sampler(SamplingParams(temperature=0.9, top_k=25, top_p=0.9, seed=11))
    ref = np.random.default_rng(11)
    for x in logits:
        ids, probs = s.probs(x)
        expected = int(ids[ref.choice(len(ids), p=probs)])
        assert s.sample(x) == expected


def test_batch_rows_equal_one_sampler_each():
    """Mixed settings in one batch (greedy, top-k only, top-p only, no filter): each row as if sampled alone."""
    import torch

    from zoomr.backends.sampling import sample_batch

    params = [SamplingParams(0.0, 20, 0.95, 1), SamplingParams(0.8, 5, 1.0, 2), SamplingParams(1.3, 0, 0.7, 3),
              SamplingParams(1.0, 0, 1.0, 4), SamplingParams(0.7, 20, 0.95, 5)]
    batched = [Sampler(p) for p in params]
    alone = [Sampler(p) for p in params]
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = (rng.normal(size=(len(params), 500)) * 3).astype(np.float32)
        ids, ent = sample_batch(torch.from_numpy(logits), batched, entropy=True)
        assert ids.tolist() == [s.sample(x) for s, x in zip(alone, logits)]
        assert ids[0] == int(np.argmax(logits[0]))
        z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        np.testing.assert_allclose(ent, -(p * np.log(p)).sum(-1), rtol=1e-9)
    with pytest.raises(ValueError, match="samplers"):
        sample_batch(np.zeros((2, 5), np.float32), batched)
