"""Forks on llama.cpp: candidates branch from a prefix that is decoded once, in both KV layouts."""

import numpy as np
import pytest

from zoomr.backends.base import BackendError
from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.models import resolve_model

PREFIX = ("Question: Tom has 3 apples and buys 5 more. Then he gives 2 to Ann. How many apples does Tom have now? "
          "Answer: Tom starts with 3 apples. He buys 5 more, so he has")
BRANCHES = [" eight", " seven", " nine", " many"]  # one first token per candidate


@pytest.fixture(scope="module", params=["full", "streaming"])
def be(request):
    """full → unified cache (forks share cells); streaming → one stream per sequence (forks copy)."""
    # the 47-token prefix + 2 candidate tokens fit the streaming cap (52 + 16 buffered); 40 more steps evict
    kw = dict(policy="streaming", budget=52, sink=4) if request.param == "streaming" else {}
    b = LlamaCppBackend(resolve_model(None), n_ctx=128, threads=1, max_sequences=6, **kw)
    yield b
    b.close()


def branch_ids(be) -> tuple[list[int], list[int]]:
    prefix = be.tokenizer.encode(PREFIX, special=False)
    firsts = [be.tokenizer.encode(PREFIX + b, special=False)[len(prefix)] for b in BRANCHES]
    assert len(set(firsts)) == 4
    return prefix, firsts


@pytest.mark.slow
def test_four_candidates_decode_the_prefix_once(be):
    prefix, firsts = branch_ids(be)
    parent = be.new_sequence()
    be.prefill(parent, prefix)
    submitted = be.tokens_submitted
    kids = [be.fork(parent) for _ in range(4)]
    assert be.tokens_submitted == submitted  # a fork decodes nothing
    step = be.decode_many(kids, firsts)  # one llama_decode for the four candidates
    follow = [int(np.argmax(row)) for row in step]
    singles = [be.decode(k, t) for k, t in zip(kids, follow)]
    assert be.tokens_submitted == submitted + 4 + 4  # only the candidates' own tokens, never the prefix again
    assert step.shape == (4, be.info.n_vocab)

    # each candidate sees exactly what a sequence prefilled from scratch with its tokens sees
    for kid, first, nxt, got in zip(kids, firsts, follow, singles):
        assert kid.tokens[-2:] == [first, nxt]
        fresh = be.new_sequence()
        ref = be.prefill(fresh, list(kid.tokens), all_logits=True)
        be.free(fresh)
        np.testing.assert_allclose(step[firsts.index(first)], ref[-2], atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(got, ref[-1], atol=2e-3, rtol=1e-3)
    for k in kids:
        be.free(k)
    be.free(parent)


@pytest.mark.slow
def test_candidates_evicting_do_not_move_the_parent(be):
    """Forks generate past the budget (evicting and shifting their positions); the parent is untouched."""
    prefix, firsts = branch_ids(be)
    parent = be.new_sequence()
    be.prefill(parent, prefix)
    twin = be.fork(parent)  # same state as the parent, left alone until the end
    kids = [be.fork(parent) for _ in range(3)]
    toks = firsts[:3]
    for _ in range(40):
        toks = [int(np.argmax(r)) for r in be.decode_many(kids, toks)]
    for k in kids:
        assert be.cells_held(k) == len(k.tokens) <= k.policy.cap
        assert k.evictions > 0 or be.policy_name == "full"
    assert be.cells_held(parent) == len(parent.tokens)
    np.testing.assert_allclose(be.decode(parent, firsts[3]), be.decode(twin, firsts[3]), atol=1e-4)
    for s in kids + [twin, parent]:
        be.free(s)


def test_sequence_ids_are_bounded_and_recycled(be):
    seqs = [be.new_sequence() for _ in range(be.max_sequences)]
    with pytest.raises(BackendError, match="sequence ids are in use"):
        be.fork(seqs[0])
    be.prefill(seqs[0], [1, 2, 3])
    assert be.cells_held(seqs[0]) == 3
    freed_id = seqs[0].seq_id
    be.free(seqs[0])
    with pytest.raises(ValueError, match="freed"):
        be.decode(seqs[0], 5)
    again = be.new_sequence()  # the freed id is reused, and its cells are gone
    assert again.seq_id == freed_id
    assert be.cells_held(again) == 0 and again.tokens == []
    for s in seqs[1:] + [again]:
        be.free(s)


def test_cache_sizing():
    """Forks of full KV share one pool (room for one 512-token step each); private streams stay under 8192 cells."""
    from zoomr.backends.llamacpp.engine import size_cache

    assert size_cache(4096, False, None, None) == (8, 4096 + 7 * 512)
    assert size_cache(80, True, None, None) == (8, 640)  # streaming B=64 + buffer 16
    assert size_cache(4096, True, None, None) == (2, 8192)  # sumr at -c 4096
    assert size_cache(4096, True, 1, None) == (1, 4096)
    with pytest.raises(ValueError, match="cannot hold 80 cells per sequence"):
        size_cache(80, True, 4, 300)
