"""Forks share stored KV (copy-on-write) and then diverge without touching each other.

Every check compares a forked cache with a fresh cache fed the same forwards from position 0: a
fork must answer exactly what a cache that never forked answers, whatever its parent, siblings or
children do after the fork (and in whichever order they run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zoomr.kvstore.active_set import FORK_CAPACITY, ResidentActiveSet
from zoomr.kvstore.base import FullKVCache
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.full import FullPolicy
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.keydiff import KeyDiffPolicy
from zoomr.kvstore.host_store import HostKVStore
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.snapkv import SnapKVPolicy
from zoomr.kvstore.streaming import StreamingPolicy
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy
from policy_drive import D, H, HKV, L

CPU = torch.device("cpu")
BLOCK = 4   # small blocks, so forks land mid-block and forwards cross block edges

POLICIES = {
    "full": lambda: (FullPolicy(), "resident"),
    "full-stream": lambda: (FullPolicy(), "stream"),
    "streaming": lambda: (StreamingPolicy(8, 2), "resident"),
    "h2o": lambda: (H2OPolicy(8, 3), "resident"),
    "snapkv": lambda: (SnapKVPolicy(8, 3, buffer=4), "resident"),
    "rkv": lambda: (RKVPolicy(8, 2, buffer=4), "resident"),
    "keydiff": lambda: (KeyDiffPolicy(8, 2, buffer=4), "resident"),
    "sumr": lambda: (SumRPolicy(4, segment_tokens=6), "resident"),
    "zoomr": lambda: (ZoomRPolicy(4, 2, 1, segment_tokens=6), "resident"),
}


def make(name: str):
    if name == "full-device":
        return FullKVCache(L, HKV, D, CPU, torch.float32, capacity=4)
    policy, offload = POLICIES[name]()
    return PolicyKVCache(policy, L, H, HKV, D, CPU, torch.float32, offload, block=BLOCK)


NAMES = ["full-device", *POLICIES]


def forwards(seed: int, n: int, first_T: int = 1):
    """``n`` forwards of random q/k/v: the first of ``first_T`` tokens, then single tokens whose text
    closes a sentence every 3rd and a paragraph every 7th token (so SumR/ZoomR segment and select)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = first_T if i == 0 else 1
        text = "\n\n" if i % 7 == 6 else ("." if i % 3 == 2 else " w")
        out.append((T, text, [(torch.randn(H, T, D, generator=g), torch.randn(HKV, T, D, generator=g),
                               torch.randn(HKV, T, D, generator=g)) for _ in range(L)]))
    return out


def feed(cache, fwds) -> list:
    """Run ``fwds`` through ``cache``; per forward and layer, copies of the K/V attention read."""
    seen = []
    for T, text, layers in fwds:
        step = []
        for layer, (q, k, v) in enumerate(layers):
            K, V = cache.update(layer, q, k, v)
            step.append((K.clone(), V.clone()))
        cache.end_forward([0] * T, text)
        seen.append(step)
    return seen


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def fresh(name: str, *parts) -> list:
    """What a cache that never forked reads over the concatenation of ``parts`` (the last part's reads)."""
    cache = make(name)
    for p in parts[:-1]:
        feed(cache, p)
    return feed(cache, parts[-1])


def stats(cache) -> dict:
    # allocation peaks depend on who copied what, by design; everything else must match
    d = cache.stats().as_dict()
    for key in ("device_kv_bytes", "host_kv_bytes"):
        d.pop(key)
    return d


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("child_first", [True, False])
def test_parent_and_child_diverge_without_touching_each_other(name, child_first):
    prefix, a, b = forwards(1, 23, first_T=6), forwards(2, 17), forwards(3, 17)
    parent = make(name)
    feed(parent, prefix)
    child = parent.fork()
    if child_first:   # the child writes first: its appends go in place, the parent must not see them
        got_b, got_a = feed(child, b), feed(parent, a)
    else:
        got_a, got_b = feed(parent, a), feed(child, b)
    assert same(got_a, fresh(name, prefix, a))
    assert same(got_b, fresh(name, prefix, b))
    ref = make(name)
    feed(ref, prefix)
    feed(ref, a)
    assert stats(parent) == stats(ref)


@pytest.mark.parametrize("name", NAMES)
def test_forks_of_forks_interleaved(name):
    prefix, mid, a, b, c = (forwards(s, 13, first_T=5 if s == 1 else 1) for s in range(1, 6))
    root = make(name)
    feed(root, prefix)
    child = root.fork()
    feed(child, mid)
    grandchild, sibling = child.fork(), root.fork()
    got = {key: [] for key in "rcgs"}
    # one forward each in turn, so every cache writes right after another wrote into shared buffers
    for i in range(13):
        for key, cache, part in (("g", grandchild, c), ("r", root, a), ("c", child, b), ("s", sibling, c)):
            got[key] += feed(cache, part[i:i + 1])
    assert same(got["r"], fresh(name, prefix, a))
    assert same(got["s"], fresh(name, prefix, c))
    assert same(got["c"], fresh(name, prefix, mid, b))
    assert same(got["g"], fresh(name, prefix, mid, c))


@pytest.mark.parametrize("name", ["full-stream", "sumr", "zoomr"])
def test_fork_shares_the_stored_kv(name):
    cache = make(name)
    feed(cache, forwards(1, 30, first_T=10))
    child = cache.fork()
    store, kid = cache.store, child.store
    for layer in range(L):
        assert len(store.sealed_k[layer]) == 39 // BLOCK
        assert all(a is b for a, b in zip(store.sealed_k[layer], kid.sealed_k[layer]))
        assert all(a is b for a, b in zip(store.sealed_v[layer], kid.sealed_v[layer]))
        # the tail (39 % 4 = 3 positions) is the only stored KV a fork copies
        assert kid.tail_k[layer] is not store.tail_k[layer]
        assert kid.tail_k[layer].shape[0] <= BLOCK and torch.equal(kid.tail_k[layer][:3], store.tail_k[layer][:3])
    if isinstance(cache.active, ResidentActiveSet):
        def prefix(c):
            return [K.untyped_storage().data_ptr() for p in c.active.parts[0] for K in (p.k, p.v)]

        for layer in range(L):   # the resident set is frozen into parts both sides read
            assert [p.k for p in child.active.parts[layer]] == [p.k for p in cache.active.parts[layer]]
        shared = prefix(cache)
        assert shared and child.active.k[0] is None and cache.active.k[0] is None
        feed(cache, forwards(9, 1))          # the parent appends to own buffers: the prefix stays shared
        feed(child, forwards(8, 1))          # and so does the child, copying none of it
        assert prefix(cache) == prefix(child) == shared
        assert child.active.k[0].data_ptr() != cache.active.k[0].data_ptr()
        assert child.active.n[0] == cache.active.n[0] == 1


@pytest.mark.parametrize("name", ["full", "streaming", "h2o", "snapkv", "rkv", "keydiff"])
def test_a_policy_that_never_restores_keeps_no_host_copy(name):
    """Eviction-only policies (and full KV kept resident) hold their active set only: host memory does not
    grow with the context, and a fork has no host store to share."""
    cache = make(name)
    feed(cache, forwards(1, 40, first_T=10))
    assert list(cache.store.buffers()) == [] and cache.store.allocated_bytes() == 0
    assert cache.stats().host_kv_bytes == 0
    assert cache.fork().store.n == cache.store.n == [49] * L
    with pytest.raises(RuntimeError, match="keeps no host copy"):
        cache.store.gather(0, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def test_full_device_forks_that_all_decode_hold_the_prefix_once():
    """Parent and children all append after a fork: each reads the frozen prefix in place and pays only
    for its own new positions (before: every side but the first writer copied the whole prefix)."""
    from zoomr.kvstore.stats import distinct_kv_bytes

    cache = make("full-device")
    feed(cache, forwards(1, 20, first_T=10))
    kids = [cache.fork() for _ in range(4)]
    prefix = [K.untyped_storage().data_ptr() for K, _ in cache.parts[0]]
    held = distinct_kv_bytes([cache, *kids])["device"]
    for i, side in enumerate([cache, *kids]):
        feed(side, forwards(20 + i, 3))
        assert [K.untyped_storage().data_ptr() for K, _ in side.parts[0]] == prefix
    own = 2 * L * HKV * FullKVCache.FORK_CAPACITY * D * 4      # each side's own buffers, fp32
    assert distinct_kv_bytes([cache, *kids])["device"] == held + 5 * own


def test_full_device_fork_generations_merge_past_max_parts():
    cache, ref = make("full-device"), make("full-device")
    fwds = forwards(1, 3 * (FullKVCache.MAX_PARTS + 2), first_T=3)
    for i, f in enumerate(fwds):
        if i % 3 == 0 and i:
            cache = cache.fork()          # a new generation: the winner of each step forks again
        assert same(feed(cache, [f]), feed(ref, [f]))
        assert len(cache.parts[0]) <= FullKVCache.MAX_PARTS


def test_policy_forks_share_what_they_never_write():
    z = make("zoomr")
    feed(z, forwards(1, 40, first_T=5))
    zc = z.fork()
    assert z.policy.mean_keys is not None and zc.policy.mean_keys is z.policy.mean_keys
    assert zc.policy.tracker is not z.policy.tracker
    assert all(a is b for a, b in zip(zc.policy.tracker.segments, z.policy.tracker.segments))
    assert zc.policy.ctx is zc.ctx and zc.policy.ctx.store is zc.store
    h = make("h2o")
    feed(h, forwards(1, 20, first_T=5))
    hc = h.fork()
    assert all(hc.policy.score[l] is not h.policy.score[l] and torch.equal(hc.policy.score[l], h.policy.score[l])
               for l in range(L))   # written in place every forward: copied


def random_selection(rng, written: int, resident: np.ndarray, M: int) -> torch.Tensor:
    """[Hkv, M] sorted unique positions per head, about half of them resident now."""
    rows = []
    for r in range(HKV):
        keep = rng.choice(resident[r], size=min(M // 2, resident.shape[1]), replace=False)
        rest = np.setdiff1d(np.arange(written), keep)
        rows.append(np.sort(np.concatenate([keep, rng.choice(rest, size=M - keep.size, replace=False)])))
    return torch.from_numpy(np.stack(rows))


def test_in_place_apply_equals_fresh_buffers_and_spares_shared_ones():
    """The in-place, changed-pairs-only apply (the CUDA default) checked on the CPU against the fresh
    buffers the CPU uses, over random selections; buffers shared with a fork are never rewritten."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    stores = [HostKVStore(1, HKV, D, torch.float32, CPU, block=BLOCK) for _ in range(2)]
    sets = [ResidentActiveSet(stores[0], CPU, torch.float32), ResidentActiveSet(stores[1], CPU, torch.float32, True)]
    written, forked = 0, None
    for step in range(60):
        T = 7 if step == 0 else 1
        k, v = torch.randn(HKV, T, D, generator=g), torch.randn(HKV, T, D, generator=g)
        outs = []
        for st, act in zip(stores, sets):
            st.append(0, k, v)
            outs.append(act.attend(0, k, v, torch.arange(written, written + T)))
        written += T
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        if step == 30:
            forked = sets[1].fork(stores[1].fork())
            frozen = resident_k(forked).clone()
        if step % 3 == 2:
            sel = random_selection(rng, written, sets[0].positions(0).numpy(), min(int(rng.integers(4, 12)), written))
            for act in sets:
                act.schedule(0, sel)
    assert sets[1].moved_pairs == sets[0].moved_pairs
    assert torch.equal(resident_k(forked), frozen)


def resident_k(act: ResidentActiveSet) -> torch.Tensor:
    """Layer 0's resident keys [Hkv, N, d]: the frozen parts', an indexed selection's, then the own used ones."""
    return act.kv(0)[0]


@pytest.mark.parametrize("name", ["full-device", "rkv", "zoomr"])
def test_a_family_of_forks_holds_the_prefix_once(name):
    from zoomr.kvstore.stats import distinct_kv_bytes
    cache = make(name)
    feed(cache, forwards(1, 60, first_T=20))
    cache.fork()   # a fork applies the parent's pending selection first (its next forward would)
    alone = distinct_kv_bytes([cache])
    kids = [cache.fork() for _ in range(4)]
    assert distinct_kv_bytes([cache, *kids])["host"] - alone["host"] <= 4 * 2 * L * BLOCK * HKV * D * 4
    assert distinct_kv_bytes([cache, *kids])["device"] == alone["device"]   # nothing copied before a write
    for i, kid in enumerate(kids):
        feed(kid, forwards(10 + i, 1))
    grown = distinct_kv_bytes([cache, *kids])
    # each kid appended to own buffers of FORK_CAPACITY positions and copied nothing of the shared prefix
    own = 2 * L * HKV * (FullKVCache.FORK_CAPACITY if name == "full-device" else FORK_CAPACITY) * D * 4
    assert grown["device"] == alone["device"] + 4 * own
    with pytest.raises(TypeError, match="storages"):
        distinct_kv_bytes([object()])


def test_a_scoring_fork_scores_like_a_fork_and_keeps_nothing(torch_backend):
    """Two candidates teacher-forced over one committed context: the same logits as through plain forks,
    the parent unchanged, no K/V held beyond the parent's, and a second forward through it refused."""
    from zoomr.kvstore.stats import distinct_kv_bytes

    be = torch_backend
    parent = be.new_sequence()
    be.prefill(parent, be.tokenizer.encode("Janet has 16 eggs and eats three.", special=False))
    cands = [be.tokenizer.encode(t, special=False) for t in (" She sells 13.", " Then she bakes four muffins")]
    plain = [be.fork(parent) for _ in cands]
    want = be.prefill_batch(plain, cands, all_logits=True)
    alone = distinct_kv_bytes([parent.cache])["device"]
    scoring = [be.scoring_fork(parent) for _ in cands]
    got = be.prefill_batch(scoring, cands, all_logits=True)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert distinct_kv_bytes([parent.cache] + [s.cache for s in scoring])["device"] == alone
    assert distinct_kv_bytes([parent.cache] + [s.cache for s in plain])["device"] > alone
    assert parent.cache.n_tokens == len(parent.tokens)
    with pytest.raises(RuntimeError, match="one forward"):
        be.prefill(scoring[0], cands[0])
    # the parent goes on decoding as if no scoring fork had been made
    again = be.new_sequence()
    be.prefill(again, parent.tokens)
    np.testing.assert_allclose(be.decode(parent, 13), be.decode(again, 13), atol=1e-4)
