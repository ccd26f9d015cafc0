"""TriAttention end to end on the embedded model: both backends under their budget with the prompt pinned, and the
same decisions on both for the same tokens (which only holds when llama.cpp's key layout, interleaved RoPE pairs
for a Llama GGUF, is read as such)."""

from __future__ import annotations

import numpy as np
import pytest

from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.models import resolve_model
from zoomr.backends.torch.calibrate import calibrate, rope_spec
from zoomr.backends.query_stats import write_stats
from zoomr.evaluation.eviction_trace import compare_evictions
from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did Natalia sell altogether in April and May?")
B = 64


@pytest.fixture(scope="module")
def stats_file(torch_backend, tmp_path_factory):
    """The embedded model's statistics on 512 tokens of the calibration text (the default 2,048 takes longer)."""
    stats, used = calibrate(torch_backend, tokens=512)
    return str(write_stats(tmp_path_factory.mktemp("tri") / "smollm2.safetensors", stats, rope_spec(torch_backend),
                           model_sha256="0" * 64, model_name="smollm2-135m", tokens=used, text="test"))


def _greedy(be, seq, ids, n):
    tok, out = int(np.argmax(be.prefill(seq, ids))), []
    for _ in range(n):
        out.append(tok)
        tok = int(np.argmax(be.decode(seq, tok)))
    return out


def test_torch_stays_within_b_plus_128_with_the_prompt_pinned(torch_backend, stats_file):
    view = torch_backend.with_cache_factory(PolicyCacheFactory(PolicySpec("triattention", B, stats_file=stats_file)))
    seq = view.new_sequence()
    ids = view.tokenizer.encode(PROMPT)
    _greedy(view, seq, ids, 330)
    kv = view.kv_stats(seq)
    assert kv.extra["compressions"] == 2 and kv.peak_active_tokens == B + 128 and kv.bound_tokens == B + 128
    for layer in (0, 29):
        pos = seq.cache.positions(layer)
        assert all(set(range(len(ids))) <= set(row.tolist()) for row in pos)
        assert pos.shape[1] <= B + 128 and int(pos.max()) == len(ids) + 330 - 1
    assert not (seq.cache.positions(0)[0] == seq.cache.positions(0)[1]).all()   # per KV head
    assert (seq.cache.positions(0) == seq.cache.positions(29)).all()            # the same in every layer


def test_llamacpp_stays_within_its_cells_and_decides_as_torch_does(torch_backend, stats_file):
    llama = LlamaCppBackend(resolve_model(None), n_ctx=1024, threads=1, policy="triattention", budget=B,
                            stats_file=stats_file)
    seq = llama.new_sequence()
    ids = llama.tokenizer.encode(PROMPT)
    text = _greedy(llama, seq, ids, 330)
    assert seq.evictions == 2 and len(seq.tokens) <= seq.policy.bound
    assert set(range(len(ids))) <= set(seq.origin)
    assert llama.kv_stats(seq).extra["policy"] == "triattention(B=64, buffer=128, offsets=17, shared)"
    llama.free(seq)
    shared = torch_backend.with_cache_factory(PolicyCacheFactory(PolicySpec("triattention", B, selection="shared",
                                                                            stats_file=stats_file)))
    agree = compare_evictions(shared, llama, ids, text)
    assert agree.evictions == 2
    assert agree.position_share >= 0.9, agree
    llama.close()
