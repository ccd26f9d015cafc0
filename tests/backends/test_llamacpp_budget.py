"""Streaming eviction on llama.cpp: generation past -c inside budget + buffer cells."""

import json
import subprocess

import numpy as np
import pytest

from zoomr.backends.llamacpp.engine import LlamaCppBackend
from zoomr.backends.llamacpp.policies import STREAMING_BUFFER
from zoomr.backends.models import resolve_model
from conftest import ROOT, zoomr_cmd

# --window defaults to B - sink (recent tokens kept, as on the torch backend); the cache then moves
# between B and B + buffer cells, which is below budget + window
BUDGET, SINK = 64, 4
CAP = BUDGET + STREAMING_BUFFER


@pytest.mark.slow
def test_cli_solve_streaming_budget_completes(tmp_path):
    out = tmp_path / "run.json"
    cmd = zoomr_cmd() + ["solve", "examples/problem.txt", "--backend", "llamacpp", "--policy", "streaming",
                         "--budget", str(BUDGET), "-c", "256", "-n", "600", "--no-live", "-t", "1", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "answer:" in r.stdout
    assert "llama_" not in r.stderr and "ggml" not in r.stderr  # llama.cpp's own log stays silent
    rec = json.loads(out.read_text())
    kv = rec["kv"]
    assert rec["prompt_tokens"] > CAP  # even the prompt had to be prefilled in evicting chunks
    assert rec["stop_reason"] in ("eos", "length")  # never "context": the budget frees room forever
    assert kv["full_tokens"] == rec["prompt_tokens"] + rec["tokens_generated"]
    assert kv["evictions"] > 0
    assert kv["peak_active_tokens"] <= CAP
    assert kv["llama_peak_cells"] <= CAP
    assert kv["active_tokens"] == kv["llama_cells"] <= CAP


@pytest.mark.slow
def test_generation_runs_far_past_the_context_inside_the_budget():
    """200 decode steps with -c 96: after every step llama.cpp holds < B + buffer cells at positions 0 … n-1
    (B + buffer at the peak), and exactly the sinks and the most recent tokens."""
    import llama_cpp

    be = LlamaCppBackend(resolve_model(None), n_ctx=96, threads=1, policy="streaming", budget=BUDGET, sink=SINK,
                         max_sequences=1)
    try:
        written = be.tokenizer.encode("Let us count the apples one by one and write every step down:", special=False)
        seq = be.new_sequence()
        logits = be.prefill(seq, written)
        mem = be._mem
        for _ in range(200):
            tok = int(np.argmax(logits))
            logits = be.decode(seq, tok)
            written.append(tok)
            n = len(seq.tokens)
            # grows to CAP during the step that fills it (the peak, checked below), then back to BUDGET
            assert n == len(written) if len(written) < CAP else BUDGET <= n < CAP
            assert llama_cpp.llama_memory_seq_pos_min(mem, seq.seq_id) == 0
            assert llama_cpp.llama_memory_seq_pos_max(mem, seq.seq_id) == n - 1
            assert seq.tokens == written[:SINK] + written[len(written) - (n - SINK):]
        st = be.kv_stats(seq)
        assert st.full_tokens == len(written) > 2 * be.n_ctx
        assert st.peak_active_tokens == st.extra["llama_peak_cells"] == CAP
        assert st.extra["evicted_tokens"] == len(written) - st.active_tokens
        assert st.active_bytes == st.active_tokens * 2 * 30 * 3 * 64 * 2  # f16 K and V, 30 layers, 3 KV heads × 64
        assert np.isfinite(logits).all()
    finally:
        be.close()


def test_kv_bytes_match_llamacpp_state_size():
    """kv_stats bytes agree with the size llama.cpp serializes for the sequence (KV + a small header)."""
    import llama_cpp

    be = LlamaCppBackend(resolve_model(None), n_ctx=256, threads=1, max_sequences=1)
    try:
        seq = be.new_sequence()
        be.prefill(seq, be.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8, special=False))
        state = llama_cpp.llama_state_seq_get_size(be._ctx, seq.seq_id)
        active = be.kv_stats(seq).active_bytes
        assert active <= state < active + 4096
    finally:
        be.close()


@pytest.mark.parametrize("kw, message", [
    (dict(budget=90), "exceed -c 96"),
    (dict(budget=4, sink=4), "leaves no recent window"),
    (dict(budget=64, window=62), "smaller than --sink 4 \\+ --window 62"),
])
def test_streaming_parameters_that_do_not_fit_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        LlamaCppBackend(resolve_model(None), n_ctx=96, policy="streaming", **kw)
