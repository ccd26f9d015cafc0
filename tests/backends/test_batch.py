"""Batched decoding: B sequences per forward, each with its own KV policy, equal to decoding them one by one."""

import numpy as np
import pytest
import torch

from zoomr.backends.sampling import Sampler, SamplingParams, sample_batch
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.full import FullPolicy
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.keydiff import KeyDiffPolicy
from zoomr.kvstore.registry import policy_names
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.snapkv import SnapKVPolicy
from zoomr.kvstore.streaming import StreamingPolicy
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.triattention import TriAttentionPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy

TEXTS = ["The capital of France is", "Count: 1, 2, 3, 4, 5, 6, 7, 8. Next we add the numbers and then we",
         "Tom has 3 apples. He buys 5 more. How many"]
STEPS = 24
FINISH_AT = 10  # the middle sequence leaves the batch after this many decode steps
# small budgets and buffers, so every selecting policy changes its selection within a short run
SMALL = {
    "full": lambda: FullPolicy(),
    "streaming": lambda: StreamingPolicy(16, sink=4),
    "h2o": lambda: H2OPolicy(16),
    "snapkv": lambda: SnapKVPolicy(16, window=4, buffer=8),
    "rkv": lambda: RKVPolicy(16, window=4, buffer=8),
    "keydiff": lambda: KeyDiffPolicy(16, window=4, buffer=8),
    "sumr": lambda: SumRPolicy(window=16, segment_tokens=16),
    "zoomr": lambda: ZoomRPolicy(window=16, topk=1, consensus=1, segment_tokens=16),
    "triattention": lambda: TriAttentionPolicy(16, buffer=8),
}
BUDGETED = ("streaming", "h2o", "snapkv", "rkv", "keydiff", "triattention")


def test_every_torch_policy_has_a_small_setting_here():
    assert set(policy_names("torch")) == set(SMALL)


def backend_for(torch_backend, policy: str):
    c = torch_backend.cfg

    def factory(backend):
        return PolicyKVCache(SMALL[policy](), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, backend.device,
                             backend.kv_dtype)

    return torch_backend.with_cache_factory(factory)


def single_runs(be, prompts):
    """Greedy tokens and logits of each prompt decoded alone, the middle one only up to FINISH_AT steps."""
    out = []
    for i, p in enumerate(prompts):
        seq = be.new_sequence()
        logits = [be.prefill(seq, p)]
        toks = []
        for _ in range(FINISH_AT if i == 1 else STEPS):
            toks.append(int(np.argmax(logits[-1])))
            logits.append(be.decode(seq, toks[-1]))
        out.append((toks, logits, seq))
    return out


@pytest.mark.parametrize("policy", list(SMALL))
@pytest.mark.slow
def test_batch_equals_single(torch_backend, policy):
    """Ragged prompts, different selections, one sequence finishing mid-batch: token-identical, logits 1e-4."""
    be = backend_for(torch_backend, policy)
    prompts = [be.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == 3
    ref = single_runs(be, prompts)
    seqs = [be.new_sequence() for _ in prompts]
    rows = list(range(3))
    logits = be.prefill_batch(seqs, prompts)
    for step in range(STEPS):
        for j, b in enumerate(rows):
            np.testing.assert_allclose(logits[j], ref[b][1][step], atol=1e-4, rtol=0)
        if step == FINISH_AT:
            # the middle sequence is done: the batch shrinks and the others go on
            logits = logits[[0, 2]]
            rows = [0, 2]
        toks = [int(np.argmax(r)) for r in logits]
        assert toks == [ref[b][0][step] for b in rows]
        logits = be.decode_batch([seqs[b] for b in rows], toks)
    for j, b in enumerate(rows):
        np.testing.assert_allclose(logits[j], ref[b][1][STEPS], atol=1e-4, rtol=0)
    for b in range(3):
        assert seqs[b].tokens == ref[b][2].tokens
        assert seqs[b].cache.n_tokens == ref[b][2].cache.n_tokens
        for layer in (0, be.cfg.n_layers - 1):
            assert torch.equal(seqs[b].cache.positions(layer), ref[b][2].cache.positions(layer))
    if policy in BUDGETED:
        attended = [s.cache.stats().active_tokens for s in seqs]
        assert all(a < s.cache.n_tokens for a, s in zip(attended, seqs))   # every one evicted ...
        sel = [seqs[b].cache.positions(0) for b in range(3)]
        assert not all(torch.equal(sel[0], x) for x in sel[1:])              # ... and each its own way


@pytest.mark.slow
def test_padded_attention_equals_per_sequence(torch_backend):
    be = backend_for(torch_backend, "rkv")
    prompts = [be.tokenizer.encode(t) for t in TEXTS]
    a, b = [be.new_sequence() for _ in prompts], [be.new_sequence() for _ in prompts]
    la, lb = be.forward_batch(a, prompts), be.forward_batch(b, prompts)
    for _ in range(16):
        toks = la.argmax(-1).tolist()
        assert toks == lb.argmax(-1).tolist()
        la = be.forward_batch(a, [[t] for t in toks], attention="per_seq")
        lb = be.forward_batch(b, [[t] for t in toks], attention="padded")
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)


def test_all_logits_and_device_logits(torch_backend):
    be = torch_backend
    prompts = [be.tokenizer.encode(t) for t in TEXTS]
    seqs = [be.new_sequence() for _ in prompts]
    rows = be.prefill_batch(seqs, prompts, all_logits=True)
    assert [r.shape for r in rows] == [(len(p), be.cfg.vocab) for p in prompts]
    for p, r in zip(prompts, rows):
        alone = be.prefill(be.new_sequence(), p, all_logits=True)
        np.testing.assert_allclose(r, alone, atol=1e-4, rtol=0)
    dev = be.decode_batch(seqs, [1, 2, 3], on_device=True)
    assert isinstance(dev, torch.Tensor) and dev.shape == (3, be.cfg.vocab) and dev.device == be.device
    ids, ent = sample_batch(dev, [Sampler(SamplingParams(temperature=0.0)) for _ in seqs], entropy=True)
    assert ids.tolist() == dev.argmax(-1).tolist() and ent.shape == (3,) and (ent > 0).all()


def bad_batches(seq_a, seq_b, n_ctx):
    return [
        ([], [], "at least one sequence"),
        ([seq_a, seq_b], [[1]], "one id list per sequence"),
        ([seq_a, seq_a], [[1], [2]], "appears twice"),
        ([seq_a, seq_b], [[1], []], "zero tokens"),
        ([seq_a], [[10 ** 9]], "vocabulary"),
        ([seq_a, seq_b], [[1], [1] * (n_ctx + 1)], "context full"),
    ]


def test_bad_batches_are_one_line_value_errors(torch_backend):
    be = torch_backend
    a, b = be.new_sequence(), be.new_sequence()
    be.prefill(a, [1, 2])
    for seqs, ids, words in bad_batches(a, b, be.n_ctx):
        with pytest.raises(ValueError, match=words) as e:
            be.prefill_batch(seqs, ids)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="one token per sequence"):
        be.decode_batch([a, b], [1])
    assert a.tokens == [1, 2] and a.cache.n_tokens == 2 and b.tokens == []   # nothing advanced


@pytest.fixture(scope="module", params=["full", "streaming"])
def llama(request):
    """full → one unified cache; streaming → one stream per sequence (a batch then spans streams)."""
    from zoomr.backends.llamacpp.engine import LlamaCppBackend
    from zoomr.backends.models import resolve_model

    kw = dict(policy="streaming", budget=48, sink=4) if request.param == "streaming" else {}
    be = LlamaCppBackend(resolve_model(None), n_ctx=128, threads=1, max_sequences=4, **kw)
    yield be
    be.close()


def test_llamacpp_batch_equals_single(llama):
    be = llama
    prompts = [be.tokenizer.encode(t, special=False) for t in TEXTS]
    seqs = [be.new_sequence() for _ in prompts]
    submitted = be.decode_calls
    first = be.prefill_batch(seqs, prompts)
    assert be.decode_calls == submitted + 1   # the three prompts in one llama_decode
    step = be.decode_batch(seqs, [int(np.argmax(r)) for r in first])
    assert step.shape == (3, be.info.n_vocab)
    for s, p, f, g in zip(seqs, prompts, first, step):
        fresh = be.new_sequence()
        ref = be.prefill(fresh, list(s.tokens), all_logits=True)
        be.free(fresh)
        np.testing.assert_allclose(f, ref[len(p) - 1], atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(g, ref[-1], atol=2e-3, rtol=1e-3)
    rows = be.prefill_batch(seqs[:2], [[5, 6], [7]], all_logits=True)
    assert [r.shape[0] for r in rows] == [2, 1]
    for s in seqs:
        be.free(s)


def test_llamacpp_bad_batches(llama):
    be = llama
    a, b = be.new_sequence(), be.new_sequence()
    be.prefill(a, [1, 2])
    for seqs, ids, words in bad_batches(a, b, be.n_ctx):
        if words == "context full" and not be.unified:
            continue   # an evicting policy makes room: no prompt is too long for it
        with pytest.raises(ValueError, match=words) as e:
            be.prefill_batch(seqs, ids)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="one token per sequence"):
        be.decode_batch([a, b], [1])
    assert a.tokens == [1, 2] and b.tokens == []
    be.free(a)
    be.free(b)


def test_full_kv_forks_decode_over_their_shared_prefix_as_if_never_forked(torch_backend):
    """Forks of a full-KV sequence read the frozen prefix in place (attention over parts, softmax merged):
    the same logits as a sequence that never forked, decoded one by one or as a batch."""
    tok = torch_backend.tokenizer
    prompt = tok.encode(TEXTS[1], add_bos=False, special=False)
    parent = torch_backend.new_sequence()
    torch_backend.prefill(parent, prompt)
    kids = [torch_backend.fork(parent) for _ in range(3)]
    tails = [[11, 12, 13], [21], [31, 32], [41, 42]]
    torch_backend.prefill(kids[0], tails[0][:1])
    grand = torch_backend.fork(kids[0])                    # a second generation: two frozen parts
    torch_backend.prefill(grand, tails[3][:1])
    got = [torch_backend.prefill(kids[0], tails[0][1:], all_logits=True)[-1],
           torch_backend.decode(kids[1], tails[1][0])]
    got += list(torch_backend.decode_batch([kids[2], grand], [tails[2][0], tails[3][1]]))
    assert len(grand.cache.parts[0]) == 2 and len(kids[2].cache.parts[0]) == 1
    for logits, tail in zip(got, [tails[0], tails[1], tails[2][:1], tails[0][:1] + tails[3]]):
        ref = torch_backend.prefill(torch_backend.new_sequence(), prompt + tail)
        np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
