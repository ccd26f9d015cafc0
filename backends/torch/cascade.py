"""Decode attention for forks that share a prefix: the shared keys are read once for the whole group.

Forks of one sequence (rescue's candidates, the forks of one prompt) attend the same frozen parts and
then a short part of their own (:class:`zoomr.kvstore.base.FullKVCache`,
:class:`zoomr.kvstore.active_set.ResidentActiveSet`). Read one fork at a time, every fork repeats the
score and value products over the shared prefix in small calls of its own; read as a group, the
queries of all forks are stacked, so each shared part costs one product for the whole group and the
own parts one zero-padded product. The softmax is taken jointly over the shared and own scores, so each
row equals attention over its fork's parts concatenated, up to the rounding of the reordered fp32 sums:
hence opt-in, ``Decoder.forward_batch(..., attention="cascade")`` (see there), never the default.

Source: cascade (shared-prefix) attention as in FlashInfer's cascade inference and Hydragen; the
arithmetic is :func:`zoomr.backends.torch.model.attend_parts`'s, batched over forks.
"""

from __future__ import annotations

import torch

Parts = list[tuple[torch.Tensor, torch.Tensor]]


def shared_prefix_groups(parts_per_row: list[Parts]) -> list[list[int]]:
    """Rows of a decode batch that share every attended part but their last (own) one.

    Args:
        parts_per_row: for each row (one new token of one sequence), the (K [Hkv, n_i, d], V) parts it
            attends in position order, the sequence's own positions last.
    Returns:
        groups of ≥ 2 row indices, ascending; rows with a single part, whose leading parts no other row
        shares, or whose own part is longer than the shared ones are in none. Parts count as shared when
        they are the same memory (pointer, length and strides of K and V), so what is grouped is equal by
        construction, never compared. The length rule is a cost one: the group copies the own parts into
        one padded tensor at every layer, which pays while the prefix it reads once is the larger part
        (a fork decoding far past its prompt goes back to the per-sequence path).
    """
    groups: dict[tuple, list[int]] = {}
    for row, parts in enumerate(parts_per_row):
        if len(parts) < 2 or parts[-1][0].shape[1] > sum(K.shape[1] for K, _ in parts[:-1]):
            continue
        key = tuple((K.data_ptr(), V.data_ptr(), K.shape, K.stride(), V.stride()) for K, V in parts[:-1])
        groups.setdefault(key, []).append(row)
    return [rows for rows in groups.values() if len(rows) > 1]


def attend_shared_prefix(q: torch.Tensor, shared: Parts, own: Parts) -> torch.Tensor:
    """One decode query per fork over the forks' shared parts plus each fork's own part.

    Args:
        q: [H, G, d] post-RoPE queries, one row per fork (G forks); H a multiple of Hkv (query head h
            reads KV head h // (H / Hkv)).
        shared: [(K_i, V_i)], each [Hkv, n_i, d]: the parts every fork attends, in position order.
        own: G pairs (K_b, V_b), each [Hkv, m_b, d] with m_b ≥ 1: fork b's own positions, which follow
            the shared ones (lengths may differ; shorter ones are zero-padded and masked).
    Returns:
        [H, G, d] in q's dtype; column b is fork b's attention output (no causal mask: every attended
        position is at or before the query's).
    """
    H, G, d = q.shape
    Hkv = shared[0][0].shape[0]
    g = H // Hkv
    rows = q.reshape(Hkv, g, G, d).transpose(1, 2).reshape(Hkv, G * g, d) * d ** -0.5   # rows (fork, member)
    scores = [torch.bmm(rows, K.transpose(1, 2)) for K, _ in shared]                     # [Hkv, G*g, n_i]
    lengths = [K.shape[1] for K, _ in own]
    M = max(lengths)
    if min(lengths) == M:
        K_own = torch.stack([K for K, _ in own])                                         # [G, Hkv, M, d]
        V_own = torch.stack([V for _, V in own])
    else:
        K_own = own[0][0].new_zeros(G, Hkv, M, d)
        V_own = torch.zeros_like(K_own)
        for b, (K, V) in enumerate(own):
            K_own[b, :, :K.shape[1]] = K
            V_own[b, :, :V.shape[1]] = V
    per_fork = rows.reshape(Hkv, G, g, d).transpose(0, 1)                                # [G, Hkv, g, d]
    s_own = torch.matmul(per_fork, K_own.transpose(2, 3)).transpose(0, 1).reshape(Hkv, G * g, M)
    if min(lengths) != M:
        pad = torch.arange(M, device=q.device)[None, :] >= torch.tensor(lengths, device=q.device)[:, None]
        s_own = s_own.masked_fill(pad.repeat_interleave(g, dim=0)[None], float("-inf"))
    p = torch.cat([*scores, s_own], dim=-1).float().softmax(dim=-1).to(q.dtype)
    out, start = None, 0
    for K, V in shared:
        n = K.shape[1]
        term = torch.bmm(p[..., start:start + n], V)                                      # [Hkv, G*g, d]
        out, start = term if out is None else out + term, start + n
    p_own = p[..., start:].reshape(Hkv, G, g, M).transpose(0, 1)                          # [G, Hkv, g, M]
    merged = out.reshape(Hkv, G, g, d).transpose(0, 1) + torch.matmul(p_own, V_own)       # [G, Hkv, g, d]
    return merged.reshape(G, H, d).transpose(0, 1)
