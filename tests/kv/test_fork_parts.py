"""Forks of a policy KV cache read the committed active set in place (frozen parts) instead of copying it.

A fork freezes each layer's resident pairs into a read-only part both sides attend; each side appends to
small buffers of its own. Checked here: with the embedded model, each side of a fork decodes exactly what
an unforked cache fed the same tokens decodes (greedy fp32, logits within 1e-4), whichever side writes
first; a fork's first append costs O(new tokens) of storage, not O(active); fork generations past the
parts cap stay bounded and correct; a compression inside a fork leaves the shared prefix to the others.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zoomr.kvstore.active_set import FORK_CAPACITY, MAX_PARTS
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.snapkv import SnapKVPolicy
from zoomr.kvstore.stats import distinct_kv_bytes
from zoomr.kvstore.zoomr import ZoomRPolicy
from policy_drive import HKV, D, L
from test_fork import POLICIES, feed, forwards, fresh, make, same

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# small budgets and buffers, so R-KV and SnapKV compress inside the fork within a short run
SMALL = {
    "rkv": lambda: RKVPolicy(16, window=4, buffer=8),
    "h2o": lambda: H2OPolicy(16),
    "snapkv": lambda: SnapKVPolicy(16, window=4, buffer=8),
    "zoomr": lambda: ZoomRPolicy(window=16, topk=1, consensus=1, segment_tokens=16),
}
PROMPT = "Janet's ducks lay 16 eggs per day. She eats three for breakfast and bakes muffins with four."
SIDE_A = " She sells the remainder at the market for $2 each, so she makes 9 times 2 = 18 dollars a day."
SIDE_B = " Then 16 - 3 - 4 = 9 eggs are left. Each egg costs two dollars, which gives 18 dollars in total."


def backend_for(torch_backend, make_policy):
    c = torch_backend.cfg

    def factory(backend):
        return PolicyKVCache(make_policy(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, backend.device,
                             backend.kv_dtype)

    return torch_backend.with_cache_factory(factory)


def decoded(be, prompt: list[int], before: list[int], after: list[int]) -> list[np.ndarray]:
    """Logits of an unforked sequence: ``prompt`` prefilled, then ``before`` and ``after`` decoded one by one
    (the logits of the ``after`` forwards)."""
    seq = be.new_sequence()
    be.prefill(seq, prompt)
    for t in before:
        be.decode(seq, t)
    out = [be.decode(seq, t) for t in after]
    be.free(seq)
    return out


@pytest.mark.parametrize("name", list(SMALL))
@pytest.mark.slow
def test_both_sides_of_a_fork_decode_like_unforked_caches(torch_backend, name):
    be = backend_for(torch_backend, SMALL[name])
    enc = be.tokenizer.encode
    prompt, a, b = enc(PROMPT, special=False), enc(SIDE_A, special=False), enc(SIDE_B, special=False)
    before, a, b = a[:6], a[6:], b[:len(a) - 6]
    parent = be.new_sequence()
    be.prefill(parent, prompt)
    for t in before:
        be.decode(parent, t)
    child = be.fork(parent)   # (applies a pending selection first, for both)
    for layer in range(be.cfg.n_layers):   # the fork reads what the parent holds
        assert torch.equal(child.cache.positions(layer), parent.cache.positions(layer))
    assert parent.cache.active.parts[0] and child.cache.active.parts[0]
    got_a, got_b = [], []
    for i, (ta, tb) in enumerate(zip(a, b)):   # the sides take turns; the child writes first every other step
        if i % 2:
            got_a.append(be.decode(parent, ta))
            got_b.append(be.decode(child, tb))
        else:
            got_b.append(be.decode(child, tb))
            got_a.append(be.decode(parent, ta))
    for got, want in ((got_a, decoded(be, prompt, before, a)), (got_b, decoded(be, prompt, before, b))):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
    if name in ("rkv", "snapkv", "h2o"):
        # each side selected since the fork: both left the shared prefix (their own buffers hold the selection)
        assert not parent.cache.active.parts[0] and not child.cache.active.parts[0]
        assert not torch.equal(parent.cache.positions(0), child.cache.positions(0))


def test_a_forks_first_append_stores_its_new_tokens_not_the_active_set(torch_backend):
    be = backend_for(torch_backend, lambda: RKVPolicy(64))
    c = be.cfg
    parent = be.new_sequence()
    be.prefill(parent, be.tokenizer.encode(PROMPT + SIDE_A + SIDE_B, special=False))
    alone = distinct_kv_bytes([parent.cache])["device"]
    active = parent.cache.stats().active_bytes
    assert parent.cache.stats().active_tokens > 4 * FORK_CAPACITY
    kids = [be.fork(parent) for _ in range(4)]
    assert distinct_kv_bytes([parent.cache] + [k.cache for k in kids])["device"] == alone
    for i, kid in enumerate(kids):
        be.decode(kid, 100 + i)
    be.decode(parent, 99)
    own = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * FORK_CAPACITY   # fp32 K and V, all layers
    held = distinct_kv_bytes([parent.cache] + [k.cache for k in kids])["device"]
    assert held == alone + 5 * own and own < active / 4


@pytest.mark.parametrize("name", [n for n in POLICIES if n != "full-stream"])
def test_fork_generations_past_the_parts_cap(name):
    """A fork of a fork of a fork ...: the newest generation decodes as an unforked cache, a sibling forked at
    every generation writes without disturbing it, and no layer ever holds more than MAX_PARTS parts."""
    cache, ref = make(name), make(name)
    fwds = forwards(1, 2 * (MAX_PARTS + 3), first_T=5)
    most = 0
    for i, f in enumerate(fwds):
        if i and i % 2 == 0:
            sibling = cache.fork()
            cache = cache.fork()
            feed(sibling, forwards(100 + i, 2))
        assert same(feed(cache, [f]), feed(ref, [f]))
        most = max(most, *(len(cache.active.parts[layer]) for layer in range(L)))
        assert most <= MAX_PARTS
    if name == "full":   # never selects: every generation adds a part, so the cap was reached and merged
        assert most == MAX_PARTS
    assert all(torch.equal(cache.positions(layer), ref.positions(layer)) for layer in range(L))


def test_a_compression_inside_a_fork_leaves_the_shared_prefix_to_the_others():
    prefix, a, b = forwards(1, 20, first_T=6), forwards(2, 9), forwards(3, 9)
    parent = make("rkv")   # R-KV, B = 8, buffer 4: compresses within a few forwards
    feed(parent, prefix)
    child = parent.fork()
    shared = [[p.k for p in parent.active.parts[layer]] for layer in range(L)]
    got_b = feed(child, b)
    assert child.policy is not parent.policy and all(not child.active.parts[layer] for layer in range(L))
    assert all(x is y for layer in range(L) for x, y in zip(shared[layer], (p.k for p in parent.active.parts[layer])))
    got_a = feed(parent, a)
    assert same(got_b, fresh("rkv", prefix, b))
    assert same(got_a, fresh("rkv", prefix, a))


def test_a_policy_reading_only_the_count_gets_no_concatenation():
    """R-KV between compressions reads how many positions are attended, not the keys: the view it gets
    never concatenates the parts (the decoder attends them in place)."""
    from zoomr.kvstore.policy import LayerView

    parent = make("rkv")
    feed(parent, forwards(1, 12, first_T=6))
    child = parent.fork()
    seen = []
    observe = child.policy.observe

    def spy(view: LayerView):
        out = observe(view)
        seen.append((len(view.key_parts), view._keys is None, out is None))
        return out

    child.policy.observe = spy
    feed(child, forwards(5, 1))
    assert seen and all(n == 2 for n, _, _ in seen)
    assert all(lazy for _, lazy, idle in seen if idle)


@pytest.mark.parametrize("name", ["rkv", "snapkv", "h2o"])
def test_a_compressing_fork_keeps_reading_the_shared_pairs_in_place(name):
    """A compression inside a fork whose kept pairs are all resident copies none of them: the fork indexes the
    shared part and its own retired buffer (``ResidentActiveSet.indexed``), so everything held beyond the parent
    is the fork's own new tokens, while it reads exactly what an unforked cache reads."""
    prefix, b = forwards(1, 20, first_T=6), forwards(3, 12)
    parent = make(name)
    feed(parent, prefix)
    alone = distinct_kv_bytes([parent])["device"]
    child = parent.fork()
    got = feed(child, b)
    assert same(got, fresh(name, prefix, b))
    assert all(child.active.indexed[layer] is not None for layer in range(L))   # it compressed in place
    extra = distinct_kv_bytes([parent, child])["device"] - alone
    per_position = 2 * L * HKV * D * 4   # fp32 K and V of one position, every layer
    # its own tokens (retired at their size) and the room of the own buffer it appends to now
    assert extra <= (len(b) + FORK_CAPACITY) * per_position, (extra, (len(b) + FORK_CAPACITY) * per_position)
    # forking it again gives both sides one compact copy of the selection, read like an unforked cache
    grand = child.fork()
    assert all(child.active.indexed[layer] is None and grand.active.parts[layer] for layer in range(L))
    c = forwards(4, 5)
    assert same(feed(grand, c), fresh(name, prefix, b, c))
