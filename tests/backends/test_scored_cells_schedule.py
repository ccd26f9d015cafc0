"""llama.cpp's score-ranked cells follow R-KV's and SnapKV's schedule as the torch backend does (issue 47).

:class:`zoomr.backends.llamacpp.scored.ScoredCells` is driven here as the engine drives it (each prefill chunk, then
each decode step: ``take_kq`` then ``observe``), with seeded random queries and keys instead of llama.cpp's, and
compared step by step with the torch backend's cache in the shared selection fed the same tensors.
"""

import pytest
import torch

from zoomr.backends.llamacpp.scored import ScoredCells, Shapes
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.rkv import RKVConfig
from zoomr.kvstore.snapkv import SnapKVConfig

L, H, HKV, D = 2, 4, 2, 8
B = 64


def tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g), torch.randn(L, n, HKV, D, generator=g)


def feed_cells(cells, q, k, forwards):
    """Each (start, T) forward into ``cells`` as the engine does; the positions held after each."""
    held = []
    for s, T in forwards:
        cells.take_kq([q[layer, s:s + T].numpy() for layer in range(L)],
                      [k[layer, s:s + T].numpy() for layer in range(L)])
        cells.observe(s, [0] * T, "")
        held.append(cells.positions.tolist())
        assert len(held[-1]) <= cells.cap
    return held


def feed_torch(config, q, k, forwards):
    """The same forwards through the torch backend's cache; after each, the positions held for the next forward
    (what the next one attends, its new token aside; the last forward's are not known yet, so left out)."""
    cache = PolicyKVCache(config.build(), L, H, HKV, D, torch.device("cpu"), torch.float32)
    attended = []
    for s, T in forwards:
        for layer in range(L):
            cache.update(layer, q[layer, s:s + T].transpose(0, 1), k[layer, s:s + T].transpose(0, 1),
                         k[layer, s:s + T].transpose(0, 1))
        cache.end_forward([0] * T, "")
        attended.append(cache.positions(0)[0].tolist())
    return [a[:-1] for a in attended[1:]]


@pytest.mark.parametrize("config", [RKVConfig(B, selection="shared"), SnapKVConfig(B, selection="shared")],
                         ids=["rkv", "snapkv"])
def test_prompt_then_decode_matches_the_torch_shared_selection(config):
    """A 200-token prompt in one chunk (the engine's n_batch is 512), then 200 decode steps."""
    P, steps = 200, 200
    q, k = tensors(P + steps)
    decode = [(P + i, 1) for i in range(steps)]
    cells = ScoredCells(config)
    cells.bind(Shapes(L, H, HKV, D))
    got = feed_cells(cells, q, k, [(0, P)] + decode)
    want = feed_torch(config, q, k, [(0, P)] + decode)
    assert got[:-1] == want
    if cells.name == "rkv":   # the prompt whole until decode step 57 (256 written before it)
        assert got[0] == list(range(P)) and got[56] == list(range(P + 56))
        assert len(got[57]) == B and cells.bound == 257
    else:                     # cut at the prefill, then on the same schedule
        assert len(got[0]) == B and len(got[56]) == B + 56 and len(got[57]) == B and cells.bound == B + 128


def prefill_as_the_engine(cells, q, k, n, n_batch=512):
    """The engine's chunking of an n-token prompt: at most the room left under the cap, at most n_batch."""
    chunks, done = [], 0
    while done < n:
        t = min(n - done, cells.cap - len(cells.positions), n_batch)
        feed_cells(cells, q, k, [(done, t)])
        chunks.append(t)
        done += t
    return chunks


def test_rkv_cells_too_small_for_the_whole_prompt_are_cut_when_they_fill():
    """room 16: cap = 64 + 128 + 16 = 208 cells, too few for a 200-token prompt's 256 + 1 positions at its first
    compression: the decode step that fills the cells compresses off-schedule, then the schedule resumes. A
    300-token prompt fills them in its first chunk, which is compressed there."""
    cells = ScoredCells(RKVConfig(B), room=16)
    cells.bind(Shapes(L, H, HKV, D))
    assert cells.cap == 208
    q, k = tensors(300 + 100, seed=2)
    assert prefill_as_the_engine(cells, q, k, 200) == [200] and len(cells.positions) == 200
    held = [len(h) for h in feed_cells(cells, q, k, [(200 + i, 1) for i in range(100)])]
    assert held[6] == 207 and held[7] == B          # decode step 8 attends 208 = cap: compressed there
    assert held[55] == B + 48 and held[56] == B     # decode step 57, 256 written before it: the schedule's
    assert cells.bound == cells.cap                 # 257 would not fit: the cells' cap is the most attended

    cells = ScoredCells(RKVConfig(B), room=16)
    cells.bind(Shapes(L, H, HKV, D))
    assert prefill_as_the_engine(cells, q, k, 300) == [208, 92]   # the first chunk fills the cells
    assert len(cells.positions) == B   # the second writes position 256: compressed on the schedule
    held = [len(h) for h in feed_cells(cells, q, k, [(300 + i, 1) for i in range(100)])]
    assert max(held) < cells.cap
