"""Every policy's selection on random tensors equals a slow, literal float64 transcription of its formulas.

The transcriptions below are written from the papers (StreamingLLM, H2O, SnapKV, ZoomR §3.3 /
Algorithm 1) and from R-KV's reference code (rkv/compression/r1_kv.py, rkv/utils.py), one loop per
sum, independently of the implementation's tensor code. Each test drives the real PolicyKVCache and
compares the attended positions of every layer and KV head at every forward.
"""

import math

import numpy as np
import pytest

from zoomr.kvstore.full import FullPolicy
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.segments import BEGIN, END
from zoomr.kvstore.snapkv import SnapKVPolicy
from zoomr.kvstore.streaming import StreamingPolicy
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy
from policy_drive import D, G, H, HKV, L, drive, replay


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    z = sum(e)
    return [x / z for x in e]


def dot(a, b):
    return float(sum(x * y for x, y in zip(a, b)))


def top(cands, score, k):
    return sorted(cands, key=lambda p: -score[p])[:k]


def check(policy, ref_select, texts, n_prompt, seed=0):
    _, got, q, k = drive(policy, texts, n_prompt, seed)
    want = replay(lambda *a: ref_select(q, k, *a), n_prompt, texts)
    for f, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"forward {f}: attended sets differ"
    return got


def test_full_attends_everything():
    texts = ["x"] * 10
    got = check(FullPolicy(), lambda *a: None, texts, 5)
    assert got[-1][0][0] == list(range(15))


@pytest.mark.parametrize("sink,window", [(4, 8), (0, 5), (2, None)])
def test_streaming(sink, window):
    B = 12

    def ref(q, k, f, s, T, text, att):
        n, w = s + T, (B - sink if window is None else window)
        if n <= sink + w:
            return None
        keep = list(range(sink)) + list(range(n - w, n))
        return [[keep] * HKV] * L

    check(StreamingPolicy(B, sink, window), ref, ["x"] * 30, 6)


def test_h2o_accumulated_attention_heavy_hitters():
    B, W = 10, 4
    acc = {}

    def ref(q, k, f, s, T, text, att):
        sel = []
        for l in range(L):
            for hq in range(H):
                kv = hq // G
                for t in range(s, s + T):
                    keys = [p for p in att[l][kv] if p <= t]
                    probs = softmax([dot(q[l, hq, t], k[l, kv, p]) / math.sqrt(D) for p in keys])
                    for p, pr in zip(keys, probs):
                        acc[l, kv, p] = acc.get((l, kv, p), 0.0) + pr
            if len(att[l][0]) <= B:
                sel.append(None)
                continue
            rows = []
            for kv in range(HKV):
                recent, cand = att[l][kv][-W:], att[l][kv][:-W]
                rows.append(sorted(top(cand, {p: acc[l, kv, p] for p in cand}, B - W) + recent))
            sel.append(rows)
        return sel

    got = check(H2OPolicy(B, W), ref, ["x"] * 40, 14)
    assert any(got[f][0][0] != got[f][0][1] for f in range(len(got)))   # heads really choose differently


def snapkv_keep(q, k, l, kv, keys, obs, B, W, kernel):
    """SnapKV's kept positions of layer ``l``, KV head ``kv`` (attending ``keys``), literally: the queries at
    ``obs`` attend causally, each key's attention summed over them and averaged over the group's query heads,
    an average pool (zero padding counted), the top B − W of all but the newest W, plus those W."""
    G, d = q.shape[1] // k.shape[1], q.shape[-1]
    cand = keys[:-W]
    score = {p: 0.0 for p in cand}
    for hq in range(kv * G, (kv + 1) * G):
        for t in obs:
            visible = [p for p in keys if p <= t]
            probs = softmax([dot(q[l, hq, t], k[l, kv, p]) / math.sqrt(d) for p in visible])
            for p, pr in zip(visible, probs):
                if p in score:
                    score[p] += pr / G
    pooled = {}
    for j, p in enumerate(cand):
        window = [score[cand[j + o]] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= j + o < len(cand)]
        pooled[p] = sum(window) / kernel    # zero padding counts in the average
    return sorted(top(cand, pooled, B - W) + keys[-W:])


def rkv_keep(q, k, l, kv, keys, obs, B, W, lam, kernel):
    """R-KV's kept positions of layer ``l``, KV head ``kv`` (attending ``keys``), literally: importance from the
    queries at ``obs`` (logits max over the group's query heads, softmax over all but the newest W keys, mean,
    max pool), minus redundancy, the top B − W of all but the newest W, plus those W."""
    G, d = q.shape[1] // k.shape[1], q.shape[-1]
    cand = keys[:-W]
    imp = [0.0] * len(cand)
    for t in obs:
        logits = [max(dot(q[l, hq, t], k[l, kv, p]) for hq in range(kv * G, (kv + 1) * G)) / math.sqrt(d)
                  for p in cand]
        for j, pr in enumerate(softmax(logits)):
            imp[j] += pr / len(obs)
    pooled = [max(imp[j + o] for o in range(-(kernel // 2), kernel // 2 + 1) if 0 <= j + o < len(cand))
              for j in range(len(cand))]
    red = rkv_redundancy([k[l, kv, p] for p in keys])
    score = {p: lam * pooled[j] - (1 - lam) * red[j] for j, p in enumerate(cand)}
    return sorted(top(cand, score, B - W) + keys[-W:])


def rkv_schedule(f, s, n_attended, B, buf):
    """R-KV's runner, literally: its counter is the positions written (prompt included); after each forward the
    flag is ``counter % buf == 0``; a decode forward (never the prompt's, f = 0) after a set flag appends its
    token and compresses when at least B positions are held. A one-token forward at ``s`` follows a counter of s."""
    return f > 0 and s % buf == 0 and n_attended >= B


def snapkv_schedule(f, s, n_attended, B, buf):
    """SnapKV: the prompt when longer than B (SnapKV's prefill), then R-KV's schedule (its runner's SnapKV)."""
    return n_attended > B if f == 0 else rkv_schedule(f, s, n_attended, B, buf)


def reference(schedule, keep, n_layers=L, n_kv=HKV):
    """``make(B, W, buf, **knobs)`` gives a ``replay`` selection rule: per layer, when ``schedule(f, s, attended,
    B, buf)`` says so, ``keep(..., B, W, **knobs)`` per KV head with the layer's last W queries observed."""
    def make(B, W, buf, **knobs):
        def ref(q, k, f, s, T, text, att):
            n = s + T
            obs = list(range(n - W, n))          # the last W queries of the layer
            sel = []
            for l in range(n_layers):
                if not schedule(f, s, len(att[l][0]), B, buf):
                    sel.append(None)
                    continue
                sel.append([keep(q, k, l, kv, att[l][kv], obs, B, W, **knobs) for kv in range(n_kv)])
            return sel
        return ref
    return make


def test_snapkv_observation_window_pooled():
    B, W, buf, kernel = 12, 4, 8, 5
    ref = reference(snapkv_schedule, snapkv_keep)(B, W, buf, kernel=kernel)
    check(SnapKVPolicy(B, W, kernel=kernel, buffer=buf), ref, ["x"] * 45, 22)


def rkv_redundancy(keys_vecs):
    """R-KV cal_similarity, literally: cosine sims, diag 0, newest duplicate (>0.5) zeroed per row, column mean, softmax."""
    N = len(keys_vecs)
    unit = [v / (np.sqrt(dot(v, v)) + 1e-8) for v in keys_vecs]
    sim = [[0.0 if i == j else dot(unit[i], unit[j]) for j in range(N)] for i in range(N)]
    for i in range(N):
        dup = [j for j in range(N) if sim[i][j] > 0.5]
        sim[i][max(dup) if dup else 0] = 0.0
    return softmax([sum(sim[i][j] for i in range(N)) / N for j in range(N)])


def test_rkv_attention_minus_redundancy():
    B, W, buf, lam, kernel = 16, 8, 16, 0.1, 7
    ref = reference(rkv_schedule, rkv_keep)(B, W, buf, lam=lam, kernel=kernel)
    check(RKVPolicy(B, W, mix=lam, kernel=kernel, buffer=buf), ref, ["x"] * 60, 20)


def test_rkv_redundancy_counts_near_duplicates():
    # two identical keys: each one's newest duplicate entry is zeroed, so the pair is less redundant
    # than a third key similar to both (the literal rule of the reference code)
    from zoomr.kvstore.rkv import redundancy
    import torch

    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]])
    want = rkv_redundancy([np.array(v, dtype=np.float64) for v in keys[0].tolist()])
    assert np.allclose(redundancy(keys)[0].numpy(), want, atol=1e-6)


# --- SumR / ZoomR ---------------------------------------------------------------------------------------

# paragraphs (each ends with "\n\n", a boundary) with sentence ends (".") inside some of them
PARAS = [["w"] * 3 + [".", "w", "\n\n"], ["w"] * 5 + ["\n\n"], ["w", "w", ":", "\n\n"], ["w"] * 4 + [".", "\n\n"],
         ["w", "w", "\n\n"], ["w"] * 6 + ["\n\n"], ["w", "w", "w", "!", "\n\n"], ["w", "w", "\n\n"]]
TEXTS = [t for p in PARAS for t in p] + ["w", "w", "."]
N_PROMPT, WINDOW = 7, 8


def paragraph_segments(n_prompt, texts, upto):
    """R_i of the auto mode, literally: runs of tokens closed by a "\\n\\n" token (with --segment-tokens 8
    every paragraph of PARAS closes at its end: none is shorter than ⌈8/3⌉ = 3 tokens or longer than 8)."""
    segs, start = [], n_prompt
    for i, t in enumerate(texts[:upto - n_prompt + 1]):
        if t == "\n\n":
            segs.append(list(range(start, n_prompt + i + 1)))
            start = n_prompt + i + 1
    return segs


def extractive(seg):
    m = min(len(seg), max(4, min(16, len(seg) // 8)))
    return seg[:(m + 1) // 2] + seg[len(seg) - m // 2:]


def ends_sentence(texts, i):
    return texts[i] in (".", "!", "?", ":", "\n\n")


def base_context(n_prompt, t, w, open_start=None):
    """I_p ∪ I_w, with the segment still being written (from ``open_start``) kept whole."""
    recent = t + 1 - w if open_start is None else min(t + 1 - w, open_start)
    return set(range(n_prompt)) | set(range(max(n_prompt, recent), t + 1))


def zoomr_reference(texts, k_top, c, segments_of, ags, paper_ags=None):
    """ZoomR §3.3 / Algorithm 1 at every semantic boundary; ``segments_of(t)`` gives the closed segments
    as (R_i positions, S_i positions, positions whose keys are averaged into k̄_i). The candidates are the
    segments that start before the recent window; the selection's AG (``ags``) is recorded only with more
    than max(c, k) of them (with fewer it is fixed by construction). ``paper_ags``: the paper's AG (§4), a
    vote of every head over all the closed summaries, at every recompute that has one."""
    def ref(q, k, f, s, T, text, att):
        t = s + T - 1
        if f == 0 or not ends_sentence(texts, t - N_PROMPT):
            return None
        segs = segments_of(t)
        open_start = max([N_PROMPT] + [max(r + s_) + 1 for r, s_, _ in segs])
        recent = max(N_PROMPT, min(t + 1 - WINDOW, open_start))
        # only segments starting before the window are voted on: one wholly inside it is attended anyway
        cand = [i for i, (r, s_, _) in enumerate(segs) if min(r + s_) < recent]
        votes = [0] * len(segs)
        every = [0] * len(segs)
        for l in range(L):
            kbar = [[np.mean([k[l, kv, p] for p in key], axis=0) for _, _, key in segs] for kv in range(HKV)]
            for hq in range(H):
                alpha = {i: dot(q[l, hq, t], kbar[hq // G][i]) for i in range(len(segs))}
                for i in sorted(cand, key=lambda i: -alpha[i])[:k_top]:
                    votes[i] += 1
                for i in sorted(alpha, key=lambda i: -alpha[i])[:k_top]:
                    every[i] += 1
        if paper_ags is not None and segs:
            paper_ags.append(sum(sorted(every, reverse=True)[:c]) / sum(every))
        voted = [i for i in range(len(segs)) if votes[i] > 0]
        ranked = sorted(voted, key=lambda i: (-votes[i], -i))
        zoom, summ = ranked[:c], ranked[c:]
        if voted and len(cand) > max(c, k_top):
            ags.append(sum(votes[i] for i in zoom) / sum(votes[i] for i in voted))
        keep = base_context(N_PROMPT, t, WINDOW, open_start)
        for i in zoom:
            keep |= set(segs[i][0])
        for i in summ:
            keep |= set(segs[i][1])
        return [[sorted(keep)] * HKV] * L

    return ref


def auto_segments(t):
    return [(seg, extractive(seg), seg) for seg in paragraph_segments(N_PROMPT, TEXTS, t)]


@pytest.mark.parametrize("k_top,c", [(2, 2), (1, 1), (3, 0)])
def test_zoomr_auto_paragraphs(k_top, c):
    ags, paper_ags = [], []
    policy = ZoomRPolicy(WINDOW, k_top, c, "auto", segment_tokens=WINDOW)   # every "\n\n" closes (≥ 3 tokens)
    got = check(policy, zoomr_reference(TEXTS, k_top, c, auto_segments, ags, paper_ags), TEXTS, N_PROMPT, seed=3)
    assert policy.ag_candidates == pytest.approx(ags) and len(ags) >= 5
    assert policy.ag == pytest.approx(paper_ags) and len(paper_ags) > len(ags)
    assert len(got[-1][0][0]) < N_PROMPT + len(TEXTS)       # something really was left out


# model mode: regular text, then a delimited summary split over several tokens, repeatedly
MODEL_PARTS = [(["a"] * 5 + ["."], ["<|begin", "_of_summary|>", "s", "s", END]),
               (["b"] * 7 + [":"], [BEGIN, "s", "<|end_of", "_summary|>"]),
               (["c"] * 3 + ["."], [BEGIN, "s", "s", "s", END]),
               (["d"] * 6 + ["!"], [BEGIN, "s", END])]
MODEL_TEXTS = [t for r, s in MODEL_PARTS for t in r + s] + ["e", "e", "."]


def model_segments(t):
    """(R_i, S_i, S_i) of the closed delimited summaries up to position t (k̄_i = mean key of S_i)."""
    out, pos = [], N_PROMPT
    for r, s in MODEL_PARTS:
        reg, summ = list(range(pos, pos + len(r))), list(range(pos + len(r), pos + len(r) + len(s)))
        pos += len(r) + len(s)
        if summ[-1] <= t:
            out.append((reg, summ, summ))
    return out


def test_zoomr_model_summaries_use_summary_mean_keys():
    ags, paper_ags = [], []
    policy = ZoomRPolicy(WINDOW, 2, 1, "model")
    check(policy, zoomr_reference(MODEL_TEXTS, 2, 1, model_segments, ags, paper_ags), MODEL_TEXTS, N_PROMPT, seed=5)
    assert policy.tracker.mode_ran() == "model" and policy.ag_candidates == pytest.approx(ags) and ags
    assert policy.ag == pytest.approx(paper_ags) and paper_ags


def test_sumr_keeps_every_summary_and_never_zooms():
    def ref(q, k, f, s, T, text, att):
        t = s + T - 1
        if f == 0 or not ends_sentence(TEXTS, t - N_PROMPT):
            return None
        keep = base_context(N_PROMPT, t, WINDOW)
        for seg in paragraph_segments(N_PROMPT, TEXTS, t):
            keep |= set(extractive(seg))
        return [[sorted(keep)] * HKV] * L

    check(SumRPolicy(WINDOW, "auto", segment_tokens=WINDOW), ref, TEXTS, N_PROMPT, seed=1)
