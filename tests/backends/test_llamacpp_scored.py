"""Score-ranked policies (h2o, snapkv, rkv, keydiff) on llama.cpp: queries and keys read through cb_eval, the
torch backend's scoring code, one selection for every layer and head, positions never shifted."""

import numpy as np
import pytest

from zoomr.backends.llamacpp.capture import GraphNamesError, KQCapture
from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.models import resolve_model
from zoomr.backends.torch.engine import TorchBackend
from zoomr.evaluation.eviction_trace import compare_evictions
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec
from conftest import assert_one_line_error, zoomr

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")


def _greedy(be, seq, ids, n):
    tok, out = int(np.argmax(be.prefill(seq, ids))), []
    for _ in range(n):
        out.append(tok)
        tok = int(np.argmax(be.decode(seq, tok)))
    return out


@pytest.mark.parametrize("policy", ["h2o", "rkv", "snapkv", "keydiff"])
@pytest.mark.slow
def test_cells_stay_within_the_bound_and_keep_their_positions(policy):
    be = LlamaCppBackend(resolve_model(None), n_ctx=512, threads=1, policy=policy, budget=32)
    seq = be.new_sequence()
    ids = be.tokenizer.encode(PROMPT)
    bound = seq.policy.bound
    _greedy(be, seq, ids, 200)
    assert seq.evictions > 0
    assert len(seq.tokens) <= bound
    assert seq.origin == sorted(seq.origin) and seq.origin[-1] == seq.n_written - 1   # holes, no shift
    assert seq.origin[-1] >= len(seq.tokens)   # positions run past the cells held
    stats = be.kv_stats(seq)
    assert stats.extra["policy"].endswith("shared)")
    assert stats.extra["llama_cells"] == len(seq.tokens)
    assert stats.peak_active_tokens <= max(bound, len(ids))   # the prompt is attended whole, as on torch
    be.close()


def test_a_fork_scores_on_its_own():
    be = LlamaCppBackend(resolve_model(None), n_ctx=512, threads=1, policy="h2o", budget=16, max_sequences=2)
    parent = be.new_sequence()
    ids = be.tokenizer.encode(PROMPT)
    _greedy(be, parent, ids, 8)
    child = be.fork(parent)
    be.decode(child, 13)
    be.decode(child, 14)
    be.decode(parent, 15)
    assert child.n_written == parent.n_written + 1
    assert len(child.tokens) <= child.policy.bound and len(parent.tokens) <= parent.policy.bound
    assert child.policy.positions.tolist() == child.origin
    assert parent.policy.positions.tolist() == parent.origin
    be.close()


@pytest.mark.parametrize("policy", ["h2o", "keydiff"])
@pytest.mark.slow
def test_decisions_match_the_torch_backend_on_the_same_tokens(policy, embedded_path):
    """Same tokens, shared selection on both backends: the evictions agree except where the logits differ."""
    src = resolve_model(None)
    llama = LlamaCppBackend(src, n_ctx=512, threads=1, policy=policy, budget=24)
    prompt = llama.tokenizer.encode(PROMPT)
    seq = llama.new_sequence()
    text = _greedy(llama, seq, prompt, 160)
    llama.free(seq)
    torch_be = TorchBackend(src, device="cpu", dtype="fp32", n_ctx=1024,
                            cache_factory=PolicyCacheFactory(PolicySpec(policy, 24, selection="shared")))
    agree = compare_evictions(torch_be, llama, prompt, text)
    assert agree.evictions >= (10 if policy == "h2o" else 1)   # keydiff cuts once per 128 tokens
    assert agree.share >= 0.8, agree
    assert agree.agreed <= agree.positions and agree.position_share >= 0.9, agree
    llama.close()


def _evictions_step_by_step(be, seqs, tokens, batched):
    """The cells each sequence keeps after every step of feeding it ``tokens`` (one list per sequence)."""
    kept = [[] for _ in seqs]
    for step in range(len(tokens[0])):
        if batched:
            be.decode_batch(seqs, [t[step] for t in tokens])
        else:
            for s, t in zip(seqs, tokens):
                be.decode(s, t[step])
        for k, s in zip(kept, seqs):
            k.append(tuple(s.origin))
    return kept


@pytest.mark.slow
def test_a_batch_step_scores_each_sequence_by_its_own_rows():
    """decode_batch hands each sequence its own rows of the captured queries and keys: two prompts of different
    lengths evict in a batch as each does alone (rows given to the wrong sequence would rank the other's
    positions, which the two prompts do not share)."""
    be = LlamaCppBackend(resolve_model(None), n_ctx=512, threads=1, policy="h2o", budget=16, max_sequences=4)
    prompts = [be.tokenizer.encode(PROMPT), be.tokenizer.encode("Name three colours of the sea at dusk.")]
    tokens = [prompts[1] * 3, prompts[0]]
    runs = {}
    for batched in (False, True):
        seqs = [be.new_sequence() for _ in prompts]
        for s, ids in zip(seqs, prompts):
            be.prefill(s, ids)
        runs[batched] = _evictions_step_by_step(be, seqs, [t[:40] for t in tokens], batched)
        assert all(s.evictions > 0 for s in seqs)
        for s in seqs:
            be.free(s)
    for solo, batch in zip(runs[False], runs[True]):
        same = sum(a == b for a, b in zip(solo, batch))
        assert same >= 0.9 * len(solo), (same, len(solo))   # a 2-row matmul may round apart from a 1-row one
    be.close()


def test_minus_c_bounds_the_positions_as_on_torch():
    """Cells leave holes, so positions keep counting past what was evicted: -c limits them (the generation's
    length, as on the torch backend), and the cells held never outgrow the positions -c allows."""
    be = LlamaCppBackend(resolve_model(None), n_ctx=96, threads=1, policy="h2o", budget=16)
    seq = be.new_sequence()
    ids = be.tokenizer.encode(PROMPT)[:40]
    be.prefill(seq, ids)
    for _ in range(96 - len(ids)):
        be.decode(seq, 13)
    assert seq.n_written == 96 and seq.evictions > 0
    with pytest.raises(ValueError, match="context full: 96 \\+ 1 tokens exceed -c 96"):
        be.decode(seq, 13)
    assert seq.n_written == 96                           # nothing ran
    assert seq.policy.cap <= 96 + 1
    assert be.kv_stats(seq).extra["llama_peak_cells"] <= seq.policy.cap   # a count of cells, not a span
    be.close()


def test_per_head_selection_is_refused_on_llamacpp():
    with pytest.raises(ValueError, match="shared selection only"):
        LlamaCppBackend(resolve_model(None), n_ctx=512, policy="rkv", budget=32, selection="per-head")


def test_cli_refuses_per_head_on_llamacpp_with_one_line():
    r = zoomr("solve", "examples/problem.txt", "--backend", "llamacpp", "--policy", "h2o", "--selection",
              "per-head", "-n", "4")
    assert_one_line_error(r)
    assert "shared selection only" in r.stderr


def test_per_head_selection_is_refused_before_any_model_loads():
    from zoomr.factory import check_options
    from zoomr.options import RunOptions

    opts = RunOptions(backend="llamacpp", policy="h2o", knobs={"selection": "per-head"})
    with pytest.raises(ValueError, match="shared selection only"):
        check_options(opts)


def test_a_graph_without_the_expected_names_is_one_error_not_a_crash():
    capture = KQCapture(2, 3, 1, 8)
    capture.begin()
    with pytest.raises(GraphNamesError, match="Qcur-0"):
        capture.take(1)
