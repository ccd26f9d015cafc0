"""Host store, device active set, fork, and the policy cache inside the real decoder (embedded model)."""

import numpy as np
import pytest
import torch

from zoomr.backends.torch.engine import TorchSequence
from zoomr.kvstore.active_set import ResidentActiveSet
from zoomr.kvstore.host_store import HostKVStore
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec
from zoomr.kvstore.zoomr import ZoomRPolicy
from policy_drive import D, H, HKV, L, drive

CPU = torch.device("cpu")


def test_host_store_fills_blocks_and_gathers():
    store = HostKVStore(1, 2, 3, torch.float32, CPU, block=4)
    data = torch.randn(2, 1000, 3)
    buffers = set()
    for t in range(1000):
        store.append(0, data[:, t:t + 1], -data[:, t:t + 1])
        buffers.add(store.tail_k[0].data_ptr() if store.tail_k[0] is not None else None)
    assert len(store.sealed_k[0]) == 250 and store.tail_k[0] is None   # one block per 4 positions
    assert len(buffers) <= 251                    # no per-token reallocation
    heads, positions = torch.tensor([0, 1, 1]), torch.tensor([999, 0, 500])
    k, v = store.gather(0, heads, positions)
    assert torch.equal(k, data[heads, positions]) and torch.equal(v, -data[heads, positions])
    with pytest.raises(IndexError, match="not written"):
        store.gather(0, heads, torch.tensor([0, 1, 1000]))
    store.append(0, data[:, :9], data[:, :9])     # a forward across block edges
    assert store.n[0] == 1009 and len(store.sealed_k[0]) == 252
    assert torch.equal(store.keys(torch.arange(1000, 1009))[0], data[:, :9])


def test_active_set_moves_only_what_changed():
    store = HostKVStore(1, 2, 4, torch.float32, CPU)
    act = ResidentActiveSet(store, CPU, torch.float32)
    k, v = torch.randn(2, 50, 4), torch.randn(2, 50, 4)
    store.append(0, k, v)
    act.attend(0, k, v, torch.arange(50))
    first = torch.tensor([[1, 2, 3, 10], [4, 5, 6, 7]])
    act.schedule(0, first)
    K, _, pos = act.attend(0, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), torch.arange(50, 50))
    assert act.moved_pairs == 0                   # all were resident: gathered on the device
    assert torch.equal(K, k.gather(1, first[..., None].expand(-1, -1, 4)))
    act.schedule(0, torch.tensor([[1, 2, 20, 30], [4, 5, 6, 40]]))
    K, _, pos = act.attend(0, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), torch.arange(50, 50))
    assert act.moved_pairs == 3                   # only 20, 30 (head 0) and 40 (head 1) came from the host
    assert torch.equal(K, k.gather(1, pos[..., None].expand(-1, -1, 4)))


def test_a_selection_of_everything_resident_copies_nothing():
    """SumR/ZoomR before their window fills select every position each recompute: applied as it is, no buffer
    is rebuilt (before, each such recompute copied the whole active set, or for a fork gathered it per step)."""
    store = HostKVStore(1, 2, 4, torch.float32, CPU)
    act = ResidentActiveSet(store, CPU, torch.float32)
    k, v = torch.randn(2, 50, 4), torch.randn(2, 50, 4)
    store.append(0, k, v)
    act.attend(0, k, v, torch.arange(50))
    buffer = act.k[0].data_ptr()
    act.schedule(0, torch.arange(50).expand(2, -1))
    K, V, pos = act.attend(0, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), torch.arange(50, 50))
    assert act.unchanged_selections == 1 and act.moved_pairs == 0 and act.k[0].data_ptr() == buffer
    assert torch.equal(K, k) and torch.equal(V, v) and torch.equal(pos, torch.arange(50).expand(2, -1))
    # a fork reads the shared part in place and keeps doing so: no indexed selection gathered every forward
    other = act.fork(store)
    other.schedule(0, torch.arange(50).expand(2, -1))
    parts = other.attend_parts(0, k[:, :1], v[:, :1], torch.tensor([50]))
    assert other.indexed[0] is None and len(parts) == 2 and parts[0][0].data_ptr() == act.parts[0][0].k.data_ptr()
    act.schedule(0, torch.tensor([[1, 2, 3], [4, 5, 6]]))   # a real selection still applies
    K, _, _ = act.attend(0, torch.zeros(2, 0, 4), torch.zeros(2, 0, 4), torch.arange(50, 50))
    assert act.unchanged_selections == 1
    assert torch.equal(K, torch.stack([k[0, 1:4], k[1, 4:7]]))


def test_fork_continues_like_the_original():
    texts = (["w"] * 5 + [".", "\n\n"]) * 6
    cache, _, q, k = drive(ZoomRPolicy(8, 2, 2, "auto", segment_tokens=8), texts[:20], 5, seed=7)
    other = cache.fork()
    g = torch.Generator().manual_seed(1)
    for i, text in enumerate(texts[20:]):
        new = [torch.randn(H, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g), torch.randn(HKV, 1, D, generator=g)]
        outs = []
        for c in (cache, other):
            outs.append([c.update(layer, *new) for layer in range(L)])
            c.end_forward([0], text)
        for (ka, va), (kb, vb) in zip(*outs):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert cache.policy.ag == other.policy.ag and cache.policy.ag
    assert cache.stats().as_dict() == other.stats().as_dict()
    assert cache.policy.tracker is not other.policy.tracker and other.policy.ctx is other.ctx


PROMPT = "Solve: Tom has 3 apples and buys 4 more. How many apples does he have?"
# teacher-forced continuation: several paragraphs, so ZoomR closes segments and evicts
FORCED = (" First we read the problem and list what we know.\n\nTom starts with three apples.\n\n"
          "Then he buys four more apples.\n\nSo")


def run_tokens(backend, cache, ids, forced):
    seq = TorchSequence(cache)
    out = [backend.prefill(seq, ids)]
    for token in forced:
        out.append(backend.decode(seq, token))
    return np.stack(out), seq


@pytest.fixture(scope="module")
def reference_logits(torch_backend):
    tok = torch_backend.tokenizer
    ids, forced = tok.encode(PROMPT), tok.encode(FORCED)
    logits, _ = run_tokens(torch_backend, torch_backend.new_sequence().cache, ids, forced)
    return ids, forced, logits


@pytest.mark.parametrize("offload", ["resident", "stream"])
def test_full_through_the_store_matches_the_plain_decoder(torch_backend, reference_logits, offload):
    ids, forced, want = reference_logits
    cache = PolicyCacheFactory(PolicySpec("full", offload=offload))(torch_backend)
    got, seq = run_tokens(torch_backend, cache, ids, forced[:8])
    assert np.abs(got - want[:9]).max() <= 1e-5
    st = torch_backend.kv_stats(seq)
    assert st.active_tokens == st.full_tokens == len(ids) + 8


def test_zoomr_in_the_decoder_equals_full_until_it_first_evicts(torch_backend, reference_logits):
    ids, forced, want = reference_logits
    factory = PolicyCacheFactory(PolicySpec("zoomr", window=6, consensus=1, segment_tokens=6))
    events = []
    factory.events.subscribe(events.append)
    got, seq = run_tokens(torch_backend, factory(torch_backend), ids, forced)
    evicting = [e for e in events if e.active_tokens < e.position + 1]
    assert evicting, [e.describe() for e in events]
    last_same = evicting[0].position - len(ids) + 1     # logits row of the forward that triggered it
    assert np.abs(got[:last_same + 1] - want[:last_same + 1]).max() <= 1e-5
    assert np.abs(got[last_same + 1:] - want[last_same + 1:]).max() > 1e-3   # the eviction changed attention
    st = torch_backend.kv_stats(seq)
    assert st.active_tokens < st.full_tokens and st.extra["recomputes"] == len(events)
    assert st.extra["summaries_mode"] == "paragraphs" and st.extra["segments"] >= 3


def test_query_window_holds_the_newest_queries_across_prefill_and_decode_and_forks():
    from zoomr.kvstore.policy import LayerView, QueryWindow

    torch.manual_seed(0)
    allq = torch.randn(4, 30, 8)   # [H, T, d]: a 20-token prefill, then 10 decode tokens
    w = QueryWindow(6)

    def push(win, a, b):
        view = LayerView(0, allq[:, a:b], torch.empty(0), torch.empty(0), b - a, a)
        return win.push(view)

    assert push(w, 0, 20) == 6
    q, pos = w.window(0)
    assert torch.equal(q, allq[:, 14:20]) and pos.tolist() == list(range(14, 20))
    # what it holds of the prefill is its own copy of 6 queries, not a view keeping all 30 alive
    assert all(c.untyped_storage().nbytes() == c.numel() * c.element_size() for c, _ in w._chunks[0])
    fork = w.copy()
    for t in range(20, 27):
        assert push(w, t, t + 1) == 6
    q, pos = w.window(0)
    assert torch.equal(q, allq[:, 21:27]) and pos.tolist() == list(range(21, 27))
    # the fork saw none of those tokens; its own next token goes after the prefill
    push(fork, 20, 21)
    q, pos = fork.window(0)
    assert torch.equal(q, allq[:, 15:21]) and pos.tolist() == list(range(15, 21))
    # a short start: fewer than size queries held
    short = QueryWindow(6)
    assert push(short, 0, 2) == 2 and short.window(0)[1].tolist() == [0, 1]
