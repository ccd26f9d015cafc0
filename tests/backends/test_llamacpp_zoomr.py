"""ZoomR on llama.cpp: every position in a store sequence, the selection in the active one (seq_rm / seq_cp)."""

import llama_cpp
import numpy as np
import pytest

from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.llamacpp.sequence import cells_held, position_ranges
from zoomr.backends.models import resolve_model
from zoomr.backends.torch.engine import TorchBackend
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May? Think step by step.")
KNOBS = {"window": 64, "segment_tokens": 32}


@pytest.fixture(scope="module")
def zoomr_llama():
    be = LlamaCppBackend(resolve_model(None), n_ctx=1024, threads=1, policy="zoomr", **KNOBS)
    yield be
    be.close()


def _run(be, seq, ids, n):
    tok, out = int(np.argmax(be.prefill(seq, ids))), []
    for _ in range(n):
        out.append(tok)
        tok = int(np.argmax(be.decode(seq, tok)))
    return out


@pytest.mark.slow
def test_the_store_keeps_every_position_and_the_selection_moves(zoomr_llama):
    be = zoomr_llama
    assert "saves attention, not KV memory" in be.describe() and "store keeps all" in be.describe()
    seq = be.new_sequence()
    ids = be.tokenizer.encode(PROMPT)
    out = _run(be, seq, ids, 400)
    stats = be.kv_stats(seq).extra
    assert stats["recomputes"] > 0 and seq.evicted_tokens > 0
    assert stats["restored_tokens"] > 0                     # segments zoomed back in after they had left
    assert len(seq.tokens) < seq.n_written == len(ids) + 400
    assert cells_held(be._mem, seq.store_id) == seq.n_written   # the store: positions 0 … n − 1, all there
    assert stats["llama_store_cells"] == seq.n_written
    assert seq.policy.written == ids + out
    assert seq.tokens == [seq.policy.written[p] for p in seq.origin]
    assert seq.origin[:len(ids)] == list(range(len(ids)))   # the prompt is always attended
    be.free(seq)


@pytest.mark.slow
def test_the_active_sequence_attends_exactly_the_selection():
    """The engine's bookkeeping is llama.cpp's membership: the next token's logits on the active sequence equal
    those of a spare sequence id given the selected store cells (and differ from the store's, which attends
    every position)."""
    be = LlamaCppBackend(resolve_model(None), n_ctx=1024, threads=1, policy="zoomr", max_sequences=3, **KNOBS)
    seq = be.new_sequence()
    _run(be, seq, be.tokenizer.encode(PROMPT), 150)
    assert len(seq.tokens) < seq.n_written
    at, nxt, spare = seq.n_written, 13, be._take_id()

    def logits_on(sid):
        be._batch.set_rows([nxt], [at], [sid])
        assert llama_cpp.llama_decode(be._ctx, be._batch.raw) == 0
        out = be._logits(0)
        llama_cpp.llama_memory_seq_rm(be._mem, sid, at, -1)
        return out

    for p0, p1 in position_ranges(seq.origin):
        llama_cpp.llama_memory_seq_cp(be._mem, seq.store_id, spare, p0, p1)
    want, everything = logits_on(spare), logits_on(seq.store_id)
    got = be.decode(seq, nxt)
    assert np.abs(got - want).max() < 1e-3
    assert np.abs(got - everything).max() > 0.1
    be.close()


@pytest.mark.slow
def test_selections_match_the_torch_backend_on_the_same_tokens(zoomr_llama):
    """Same tokens, both backends: the attended set is the same after nearly every step (a vote that differs
    where the arithmetic does can change a zoomed-in segment)."""
    be = zoomr_llama
    ids = be.tokenizer.encode(PROMPT)
    seq = be.new_sequence()
    text = _run(be, seq, ids, 200)
    be.free(seq)
    torch_be = TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=1024,
                            cache_factory=PolicyCacheFactory(PolicySpec("zoomr", **KNOBS)))
    ts, ls = torch_be.new_sequence(), be.new_sequence()
    torch_be.prefill(ts, ids)
    be.prefill(ls, ids)
    same = 0
    for tok in text:
        torch_be.decode(ts, tok)
        be.decode(ls, tok)
        pending = getattr(ts.cache.active, "pending", [None])[0]
        kept = ts.cache.positions(0) if pending is None else pending
        same += set(kept[0].tolist()) == set(ls.origin)
    be.free(ls)
    assert same >= 0.9 * len(text), same
