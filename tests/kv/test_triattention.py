"""TriAttention against its description (github WeianMao/triattention, the HF path), on fixed seeded tensors.

The reference's steps are written out here in float64 numpy, as the reference describes them and independently
of how :mod:`zoomr.kvstore.triattention` computes them (it folds the RoPE inversion and the 17 offsets into one
rotated "virtual query"): undo each key's RoPE at its position, pair dimensions as complex numbers, average the
trigonometric series over the offsets, add the magnitude term; z-score each query head over the candidates, max
over a KV head's query group, mean over layers, top-k per KV head, the prompt pinned. The policy runs through a
real :class:`zoomr.kvstore.cache.PolicyKVCache`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zoomr.backends.torch.rope import RotaryTable, apply_rotary, inv_frequencies
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.policy import ForwardInfo, LayerView, PolicyContext
from zoomr.kvstore.registry import PolicySpec
from zoomr.kvstore.triattention import (OFFSETS, QueryStats, TriAttentionPolicy, complex_pairs, head_scores,
                                        unrotate, virtual_queries, offset_phasor)

L, H, HKV, D = 2, 4, 2, 8
F = D // 2
G = H // HKV
OMEGA = inv_frequencies(D, 10000.0, None)


def seeded_stats(seed: int = 0) -> QueryStats:
    g = torch.Generator().manual_seed(seed)
    q = torch.complex(torch.randn(L, H, F, generator=g), torch.randn(L, H, F, generator=g))
    spread = torch.rand(L, H, F, generator=g) + 0.1
    return QueryStats(q.to(torch.complex64), (q.abs() + spread).float(), OMEGA)


def rope_interleaved(x: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """llama.cpp's NORM RoPE: pairs (2f, 2f + 1) turned by p·ω_f."""
    ang = pos.double()[:, None] * omega.double()[None, :]
    c, s = ang.cos().float(), ang.sin().float()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def rope_half(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The torch backend's own RoPE (HF rotate-half)."""
    cos, sin = RotaryTable(OMEGA, torch.device("cpu"), torch.float32, n=8).get(pos)
    return apply_rotary(x, cos, sin)


def literal_scores(keys: np.ndarray, pos: np.ndarray, q_mean: np.ndarray, q_abs: np.ndarray, t: int,
                   style: str) -> np.ndarray:
    """The reference's per-head score of post-RoPE keys [C, d] at positions [C] (float64)."""
    if style == "half":
        k = keys[:, :F] + 1j * keys[:, F:]
    else:
        k = keys[:, 0::2] + 1j * keys[:, 1::2]
    omega = OMEGA.numpy()
    k = k * np.exp(-1j * pos[:, None] * omega[None, :])          # RoPE undone at each key's own position
    amp = np.abs(q_mean)[None, :] * np.abs(k)
    phi = np.angle(q_mean[None, :] * np.conj(k))
    series = np.mean([(amp * np.cos((t - pos[:, None] + delta) * omega[None, :] + phi)).sum(axis=1)
                      for delta in OFFSETS], axis=0)
    extra = ((q_abs - np.abs(q_mean))[None, :] * np.abs(k)).sum(axis=1)
    return series + extra


def literal_selection(keys_at, positions: np.ndarray, stats: QueryStats, t: int, pin: int, budget: int,
                      style: str = "half", shared: bool = False) -> np.ndarray:
    """The reference pipeline over one compression: per KV head [Hkv, B] positions kept (each row sorted).

    ``keys_at(layer, kv_head, position)`` is the post-RoPE key stored for that position; ``positions`` [Hkv, N]
    the positions each KV head attends (the same in every layer)."""
    q_mean, q_abs = stats.q_mean.numpy().astype(np.complex128), stats.q_abs_mean.numpy().astype(np.float64)
    agg = []
    cands = []
    for kv in range(HKV):
        cand = positions[kv][positions[kv] >= pin]
        cands.append(cand)
        per_layer = []
        for layer in range(L):
            keys = np.stack([keys_at(layer, kv, p) for p in cand])
            z = []
            for h in range(kv * G, (kv + 1) * G):
                s = literal_scores(keys, cand.astype(np.float64), q_mean[layer, h], q_abs[layer, h], t, style)
                z.append((s - s.mean()) / max(s.std(), 1e-6))
            per_layer.append(np.max(z, axis=0))
        agg.append(np.mean(per_layer, axis=0))
    agg = np.stack(agg)
    pinned = np.arange(pin)
    k = budget - pin
    if shared:
        top = cands[0][np.argsort(-agg.mean(axis=0), kind="stable")[:k]]
        return np.stack([np.sort(np.concatenate([pinned, top]))] * HKV)
    return np.stack([np.sort(np.concatenate([pinned, cands[kv][np.argsort(-agg[kv], kind="stable")[:k]]]))
                     for kv in range(HKV)])


# --- the pieces ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_inversion_undoes_the_rotation(style):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(HKV, 50, D, generator=g)
    pos = torch.randint(0, 70000, (50,), generator=g)
    rotated = rope_half(k, pos) if style == "half" else rope_interleaved(k, pos, OMEGA)
    back = unrotate(complex_pairs(rotated, style), pos, OMEGA)
    assert torch.allclose(back, complex_pairs(k, style), atol=2e-5)
    assert not torch.allclose(complex_pairs(rotated, style), complex_pairs(k, style), atol=1e-2)   # it did rotate


def test_the_offsets_are_the_reference_geometric_grid():
    assert OFFSETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    c = offset_phasor(OMEGA)
    manual = np.mean([np.exp(1j * d * OMEGA.numpy()) for d in OFFSETS], axis=0)
    assert np.allclose(c.numpy(), manual)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_per_head_scores_equal_the_reference_series(style):
    g = torch.Generator().manual_seed(2)
    stats = seeded_stats(3)
    pos = torch.sort(torch.randperm(3000, generator=g)[:40]).values
    pre = torch.randn(HKV, 40, D, generator=g)
    keys = torch.stack([rope_half(pre[h:h + 1], pos)[0] if style == "half" else rope_interleaved(pre[h], pos, OMEGA)
                        for h in range(HKV)])
    t = 3001
    layer = 1
    weight = (stats.q_mean[layer].to(torch.complex128) * offset_phasor(OMEGA)).reshape(HKV, G, F)
    virtual = virtual_queries(weight, OMEGA, t, style)
    extra = (stats.q_abs_mean[layer] - stats.q_mean[layer].abs()).reshape(HKV, G, F)
    ours = head_scores(keys, virtual, extra, style)                      # [Hkv, G, C]
    for h in range(H):
        want = literal_scores(keys[h // G].double().numpy(), pos.double().numpy(),
                              stats.q_mean[layer, h].numpy().astype(np.complex128),
                              stats.q_abs_mean[layer, h].double().numpy(), t, style)
        assert np.allclose(ours[h // G, h % G].double().numpy(), want, rtol=1e-4, atol=1e-4), h


# --- the policy, through a real cache -----------------------------------------------------------------------

class Feed:
    """A PolicyKVCache under TriAttention fed keys that are a fixed function of (layer, KV head, position)."""

    def __init__(self, budget: int, selection: str | None = None, seed: int = 5):
        self.policy = TriAttentionPolicy(budget, selection=selection)
        self.cache = PolicyKVCache(self.policy, L, H, HKV, D, torch.device("cpu"), torch.float32)
        self.stats = seeded_stats(seed)
        self.policy.use_query_stats(self.stats)
        g = torch.Generator().manual_seed(seed + 1)
        self.pre = torch.randn(L, HKV, 2048, D, generator=g)   # pre-RoPE keys by position
        self.attended = []                                         # per forward: [Hkv, N] positions of layer 0

    def key(self, layer: int, kv: int, p: int) -> np.ndarray:
        return rope_half(self.pre[layer, kv, p][None, None], torch.tensor([p]))[0, 0].double().numpy()

    def forward(self, n: int) -> None:
        start = self.cache.n_tokens
        pos = torch.arange(start, start + n)
        for layer in range(L):
            q = torch.randn(H, n, D)
            k = rope_half(self.pre[layer, :, start:start + n], pos)
            K, _ = self.cache.update(layer, q, k, torch.zeros_like(k))
            got = self.cache.positions(layer)
            for kv in range(HKV):   # every attended key is the one written at its original position
                want = rope_half(self.pre[layer, kv, got[kv]][None], got[kv])[0]
                assert torch.allclose(K[kv], want, atol=1e-5)
        self.attended.append(self.cache.positions(0).clone())
        self.cache.end_forward([0] * n, "")


def run(feed: Feed, prompt: int, steps: int) -> list[int]:
    feed.forward(prompt)
    for _ in range(steps):
        feed.forward(1)
    return [a.shape[1] for a in feed.attended]


def test_trigger_at_b_plus_128_cuts_to_b_and_never_at_the_prompt():
    B = 40
    feed = Feed(B)
    sizes = run(feed, 300, 300)                  # a prompt longer than B + 128 stays whole at its forward
    assert sizes[0] == 300 and sizes[1] == 301   # the first decode step attends it all, then cuts
    assert sizes[2] == B + 1
    assert max(sizes[2:]) == B + 128 and min(sizes[2:]) == B + 1
    cuts = [i for i in range(1, len(sizes) - 1) if sizes[i + 1] < sizes[i]]
    assert all(sizes[i] == B + 128 for i in cuts[1:]) and len(cuts) == 3
    assert feed.policy.compressions == 3 and feed.policy.bound_tokens == B + 128


def test_the_prompt_is_pinned_and_counts_in_the_budget():
    B, P = 40, 12
    feed = Feed(B)
    run(feed, P, 400)
    for a in feed.attended[1:]:
        assert all(set(range(P)) <= set(row.tolist()) for row in a)
    long = Feed(B)
    run(long, 50, 200)   # P ≥ B: the reference keeps the prompt's first B positions and nothing else
    after = [a for a in long.attended[2:] if a.shape[1] == B + 1]
    assert after and all((a[:, :B] == torch.arange(B)).all() for a in after)


@pytest.mark.parametrize("selection", ["per-head", "shared"])
def test_selection_follows_the_reference_pipeline_across_two_compressions(selection):
    """z-score per query head, max over the KV group, mean over layers, top-k per KV head, prompt pinned; the
    second compression scores the survivors at their original positions (per KV head: their rows differ)."""
    B, P = 48, 10
    feed = Feed(B, selection)
    run(feed, P, 2 * 128 + 60)
    sizes = [a.shape[1] for a in feed.attended]
    cuts = [i for i in range(1, len(sizes) - 1) if sizes[i + 1] < sizes[i]]
    assert len(cuts) == 2
    for i in cuts:
        attended = feed.attended[i].numpy()
        t = int(attended.max()) + 1
        want = literal_selection(feed.key, attended, feed.stats, t, P, B, shared=selection == "shared")
        kept = feed.attended[i + 1][:, :-1].numpy()   # the next forward attends the selection + its new token
        assert (kept == want).all(), (i, selection)
    if selection == "per-head":   # each KV head chose its own positions
        assert not (feed.attended[cuts[1]][0] == feed.attended[cuts[1]][1]).all()
    else:
        assert (feed.attended[cuts[1]][0] == feed.attended[cuts[1]][1]).all()


def test_top_k_rows_are_sorted_unique_and_b_long():
    B = 40
    feed = Feed(B)
    run(feed, 5, 200)
    for a in feed.attended:
        assert (a[:, 1:] > a[:, :-1]).all()
    assert {a.shape[1] for a in feed.attended if a.shape[1] <= B + 1} >= {B + 1}


def test_the_llamacpp_layout_regroups_layers_into_heads():
    """One "layer" of L·H query heads and L·Hkv KV heads (llama.cpp's binding) scores as the per-layer model does
    with the shared selection: the mean over KV heads of the mean over layers."""
    stats = seeded_stats(7)
    ctx = PolicyContext(1, L * H, L * HKV, D, torch.device("cpu"), None, lambda e: None)
    flat = TriAttentionPolicy(40, selection="shared")
    flat.bind(ctx)
    flat.use_query_stats(stats, "interleaved")
    g = torch.Generator().manual_seed(8)
    pre = torch.randn(L * HKV, 200, D, generator=g)
    pos = torch.arange(200)
    keys = torch.stack([rope_interleaved(pre[r], pos, OMEGA) for r in range(L * HKV)])
    flat.end_forward(ForwardInfo(0, [0] * 30, "", True))
    view = LayerView(0, torch.zeros(L * H, 1, D), keys, pos.expand(L * HKV, -1), 1, 199)
    assert flat.observe(view) is None
    got = flat.end_forward(ForwardInfo(199, [0], "", False))
    q_mean, q_abs = stats.q_mean.numpy().astype(np.complex128), stats.q_abs_mean.numpy().astype(np.float64)
    cand = np.arange(30, 200)
    per_kv = []
    for layer in range(L):
        for kv in range(HKV):
            rows = []
            for h in range(kv * G, (kv + 1) * G):
                s = literal_scores(keys[layer * HKV + kv, 30:].double().numpy(), cand.astype(np.float64),
                                   q_mean[layer, h], q_abs[layer, h], 200, "interleaved")
                rows.append((s - s.mean()) / max(s.std(), 1e-6))
            per_kv.append(np.max(rows, axis=0))
    top = cand[np.argsort(-np.mean(per_kv, axis=0), kind="stable")[:10]]
    want = np.sort(np.concatenate([np.arange(30), top]))
    assert got.shape == (L * HKV, 40) and (got.numpy() == want).all()


def test_statistics_that_do_not_fit_the_model_are_refused_and_unbound_ones_raise():
    policy = PolicySpec("triattention", 40).build()
    PolicyKVCache(policy, L, H, HKV, D, torch.device("cpu"), torch.float32)
    other = QueryStats(torch.ones(3, H, F, dtype=torch.complex64), torch.ones(3, H, F), OMEGA)
    with pytest.raises(ValueError, match="do not fit"):
        policy.use_query_stats(other)
    view = LayerView(0, torch.zeros(H, 1, D), torch.zeros(HKV, 200, D), torch.arange(200).expand(HKV, -1), 1, 199)
    policy.end_forward(ForwardInfo(0, [0] * 10, "", True))
    with pytest.raises(RuntimeError, match="no query statistics"):
        policy.observe(view)


def test_a_fork_shares_the_statistics_and_keeps_the_prompt():
    feed = Feed(40)
    run(feed, 12, 10)
    other = feed.cache.fork()
    assert other.policy.prompt_tokens == 12 and other.policy._weight is feed.policy._weight
    assert other.policy.describe() == "triattention(B=40, buffer=128, offsets=17)"


def test_match_budget_sizes_triattention_as_it_runs():
    """``bench --match-budget`` plans a matched cell for it and predicts its B by driving the real policy."""
    from zoomr.evaluation.bench_plan import plan_cells
    from zoomr.evaluation.match import predict_budget, simulated_mean_active
    from zoomr.evaluation.records import MATCHED

    assert ("triattention", MATCHED) in plan_cells(["full", "zoomr", "triattention"], [], matched=True)
    b, mean = predict_budget(PolicySpec("triattention"), 300.0, 88, 1000)
    assert abs(mean / 300.0 - 1) < 0.01 and 200 < b < 300
    feed = Feed(b)
    sizes = run(feed, 88, 1000)
    assert abs(np.mean(sizes[1:]) - simulated_mean_active(PolicySpec("triattention", b), 88, 1000)) < 1e-9
