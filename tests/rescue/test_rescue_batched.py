"""Batched KV-Rescue steps against the sequential loop, on the real embedded model (fp32, CPU).

Same seed, same settings: the committed steps, every candidate's tokens, texts, stop reasons and
aborts are identical; entropies and scores agree to the rounding a batched forward differs by.
Event order differs by design (see :mod:`zoomr.rescue.loop`), so records are compared per candidate.
"""

from dataclasses import replace

import pytest

from zoomr.backends.generation import GenerationStats, generate, generate_batch
from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.prompts import solve_prompt
from zoomr.rescue.degeneration import DetectorConfig
from zoomr.rescue.engine import Engine
from zoomr.kvstore.events import EventBus
from zoomr.rescue.loop import RescueConfig, RescueLoop
from zoomr.rescue.scorers import HelperLikelihoodScorer
from zoomr.rescue.transcript import Transcript

from conftest import JANET as QUESTION

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FLOAT_KEYS = {"entropy", "mean_entropy", "score", "min_gzip_ratio", "gzip_ratio"}


def rkv_cache(backend):
    c = backend.cfg
    return PolicyKVCache(RKVPolicy(16, buffer=8), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                         backend.device, backend.kv_dtype)


def solve(torch_backend, batched: bool, config: RescueConfig, seed: int = 0, helper=None,
          batch_sizes: list | None = None) -> tuple[str, Transcript]:
    """One run; ``helper`` defaults to the base's own weights with full KV. ``batch_sizes`` collects the
    number of sequences of every ``decode_batch`` forward of either role."""
    base = torch_backend.with_cache_factory(rkv_cache)
    helper = torch_backend if helper is None else helper
    if batch_sizes is not None:
        for be in (base, helper):
            be.decode_batch = _counting(be.decode_batch, batch_sizes)
    events, tr = EventBus(), Transcript()
    events.subscribe(tr)
    loop = RescueLoop(Engine("base", base), Engine("helper", helper), HelperLikelihoodScorer(),
                      Sampler(SamplingParams(0.8, 20, 0.95, seed)), replace(config, batched=batched), events)
    ids = solve_prompt(torch_backend.tokenizer, QUESTION)
    try:
        return loop.run(QUESTION, ids, ids), tr
    finally:
        loop.close()


def _counting(decode_batch, sizes: list):
    def call(seqs, tokens, **kw):
        sizes.append(len(seqs))
        return decode_batch(seqs, tokens, **kw)
    return call


def by_candidate(tr: Transcript) -> dict:
    """Every event but the run's header and timing, grouped per (step, candidate) in their own order."""
    out: dict = {}
    for e in tr.events:
        if e["event"] in ("run_started", "run_finished"):
            continue
        key = (e.get("step"), e.get("cand"), e["event"] if "cand" not in e else "")
        out.setdefault(key, []).append(e)
    return out


def assert_same(a, b, path="") -> None:
    """Equal, except the named float fields, which agree to 1e-3 (batched vs single forward rounding)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            if k in FLOAT_KEYS and isinstance(a[k], float):
                assert a[k] == pytest.approx(b[k], abs=1e-3), f"{path}.{k}"
            else:
                assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.slow
def test_batched_steps_commit_what_the_sequential_loop_commits(torch_backend):
    """nb = nh = 2, three steps of at most 8 tokens: same records per candidate, same summary."""
    config = RescueConfig(2, 2, 8, 3, 2048)
    r_seq, seq = solve(torch_backend, False, config)
    r_bat, bat = solve(torch_backend, True, config)
    assert r_seq == r_bat
    s_seq, s_bat = seq.summary(), bat.summary()
    s_seq.pop("seconds", None), s_bat.pop("seconds", None)
    assert len(s_seq["steps"]) >= 2
    assert_same(s_seq, s_bat)
    a, b = by_candidate(seq), by_candidate(bat)
    assert a.keys() == b.keys()
    for k in a:
        assert_same(a[k], b[k], str(k))
    # both models' candidates ran: the batches are real (more than one sequence per forward)
    assert s_bat["candidates"] == {"base": 2 * len(s_bat["steps"]), "helper": 2 * len(s_bat["steps"])}


@pytest.mark.slow
def test_a_helper_on_the_base_weights_joins_the_base_batch_and_another_model_does_not(torch_backend):
    """nb = nh = 2: with the helper a view of the base's weights, each forward carries all four candidates;
    with a separately loaded helper (its own weights) the two models batch apart. Same candidates either way."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.engine import TorchBackend

    config = RescueConfig(2, 2, 6, 2, 2048)
    shared_sizes, own_sizes = [], []
    _, shared = solve(torch_backend, True, config, batch_sizes=shared_sizes)
    other = TorchBackend(resolve_model(None), device="cpu", dtype="fp32", n_ctx=2048)
    assert not torch_backend.shares_weights(other) and torch_backend.shares_weights(torch_backend.with_cache_factory(rkv_cache))
    _, own = solve(torch_backend, True, config, helper=other, batch_sizes=own_sizes)
    assert max(shared_sizes) == 4 and max(own_sizes) == 2
    a, b = by_candidate(shared), by_candidate(own)
    assert a.keys() == b.keys()
    for k in a:
        assert_same(a[k], b[k], str(k))


@pytest.mark.slow
def test_a_candidate_aborted_mid_batch_leaves_and_the_rest_match(torch_backend):
    """A detector tight enough to abort some base candidates after a few tokens while their batch-mates go on
    (2 nats: R-KV keeps this 114-token prompt whole until position 120, so the base is less uncertain than when
    its prompt was cut at the prefill, where 3 nats sufficed)."""
    config = RescueConfig(2, 2, 10, 2, 2048, detector=DetectorConfig(max_entropy=2.0, entropy_window=2,
                                                                     entropy_guard=2))
    _, seq = solve(torch_backend, False, config)
    _, bat = solve(torch_backend, True, config)
    aborts = bat.summary()["aborts"]
    tokens = {(e["step"], e["cand"]): e["n"] for e in bat.events if e["event"] == "token"}
    # some abort came after its first tokens while the other base candidate of that step kept sampling past it
    assert any(a["signals"]["tokens"] >= 2 and tokens.get((a["step"], 1 - a["cand"]), 0) > a["signals"]["tokens"]
               for a in aborts), (aborts, tokens)
    a, b = by_candidate(seq), by_candidate(bat)
    assert a.keys() == b.keys()
    for k in a:
        assert_same(a[k], b[k], str(k))
    assert_same(seq.summary()["aborts"], aborts)


@pytest.mark.slow
def test_generate_batch_gives_each_sequence_what_generate_gives_it_alone(torch_backend):
    """Three forks of one prompt, their own seeds, one with a stop string hit early: tokens and stop reasons
    as each alone; a sequence ended by the callback leaves at once (its cache takes no more tokens)."""
    tok = torch_backend.tokenizer
    ids = solve_prompt(tok, QUESTION)
    root = torch_backend.new_sequence()
    logits = torch_backend.prefill(root, ids)
    params = SamplingParams(0.8, 20, 0.95, 7)
    alone = []
    for b in range(3):
        seq, st = torch_backend.fork(root), GenerationStats()
        list(generate(torch_backend, seq, [], Sampler(params).substream(b), 12, st, stop=("\n",), logits=logits))
        alone.append(st)
        torch_backend.free(seq)
    seqs = [torch_backend.fork(root) for _ in range(3)]
    stats = [GenerationStats() for _ in range(3)]
    seen: list[tuple[int, int]] = []

    def on_token(b, t):
        seen.append((b, t.token))
        assert t.logits is None and t.entropy is not None and t.entropy >= 0
        return b == 2 and stats[b].generated_tokens == 3      # abort sequence 2 at its third token

    generate_batch(torch_backend, seqs, [Sampler(params).substream(b) for b in range(3)], 12, stats, logits,
                   stop=("\n",), entropy=True, on_token=on_token)
    for b in range(2):
        assert stats[b].token_ids == alone[b].token_ids and stats[b].stop_reason == alone[b].stop_reason
        assert stats[b].text == alone[b].text and stats[b].next_logits.shape == logits.shape
    assert stats[2].token_ids == alone[2].token_ids[:3] and stats[2].stop_reason == "aborted"
    assert len(seqs[2].tokens) == len(ids) + 2                    # the aborted token was never decoded
    assert [t for b, t in seen if b == 2] == alone[2].token_ids[:3]
    for s in (*seqs, root):
        torch_backend.free(s)
