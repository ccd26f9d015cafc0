"""Drive a real PolicyKVCache with random q/k/v, and replay a reference selection rule over the same stream.

Shared by the reference and property tests. Shapes are small (2 layers, 4 query heads, 2 KV heads,
head dim 8) so a literal Python transcription of each formula stays fast.
"""

from __future__ import annotations

import torch

from zoomr.kvstore.cache import PolicyKVCache

L, H, HKV, D = 2, 4, 2, 8
G = H // HKV


def drive(policy, texts: list[str], n_prompt: int, seed: int = 0, shape=(L, H, HKV, D), events=None):
    """Prefill ``n_prompt`` random tokens, then one forward per text in ``texts``; the policy's recompute
    events go to ``events`` (an :class:`zoomr.kvstore.events.EventBus`, or None).

    Returns:
        (cache, attended, q, k): attended[f][layer][kv_head] = positions attended by forward f;
        q [L, H, n, d] and k [L, Hkv, n, d] as float64 numpy arrays.
    """
    nl, nh, nkv, d = shape
    g = torch.Generator().manual_seed(seed)
    n = n_prompt + len(texts)
    q = torch.randn(nl, nh, n, d, generator=g)
    k = torch.randn(nl, nkv, n, d, generator=g)
    v = torch.randn(nl, nkv, n, d, generator=g)
    cache = PolicyKVCache(policy, nl, nh, nkv, d, torch.device("cpu"), torch.float32, events=events)
    attended = []
    for s, T, text in forwards(n_prompt, texts):
        for layer in range(nl):
            K, V = cache.update(layer, q[layer, :, s:s + T], k[layer, :, s:s + T], v[layer, :, s:s + T])
            # what attention reads is exactly the stored K/V of the attended positions, new tokens last
            pos = cache.positions(layer)
            assert pos[:, -T:].tolist() == [list(range(s, s + T))] * nkv
            assert torch.equal(K, k[layer].gather(1, pos[..., None].expand(-1, -1, d)))
            assert torch.equal(V, v[layer].gather(1, pos[..., None].expand(-1, -1, d)))
        cache.end_forward(list(range(T)), text)
        attended.append([cache.positions(layer).tolist() for layer in range(nl)])
    return cache, attended, q.double().numpy(), k.double().numpy()


def forwards(n_prompt: int, texts: list[str]):
    """(start, T, text) of the prompt forward and then one single-token forward per text."""
    yield 0, n_prompt, "prompt"
    for i, text in enumerate(texts):
        yield n_prompt + i, 1, text


def replay(select, n_prompt: int, texts: list[str], n_layers: int = L, n_kv: int = HKV):
    """Reference attended sets: each forward attends the last selection (or what it attended) + its tokens.

    ``select(f, start, T, text, attended)`` returns the next selection per layer (a list of per-head
    position lists, or None to keep the attended set) given this forward's attended sets.
    """
    out, sel, att = [], [None] * n_layers, None
    for f, (s, T, text) in enumerate(forwards(n_prompt, texts)):
        new = list(range(s, s + T))
        att = [[(sel[l][h] if sel[l] is not None else (att[l][h] if att else [])) + new for h in range(n_kv)]
               for l in range(n_layers)]
        out.append(att)
        sel = select(f, s, T, text, att) or [None] * n_layers
    return out
