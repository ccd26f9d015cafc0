"""The KV-Rescue loop on the real embedded model: re-base token accounting, eviction bound, Ctrl-C, views.

Tokens are counted by the backends themselves: a subclass of the real torch backend that records what
each forward is handed (it computes exactly as the shipped one), and llama.cpp's own
``tokens_submitted`` counter.
"""

import io

import pytest
from rich.console import Console

from zoomr.backends.models import resolve_model
from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.backends.torch.engine import TorchBackend
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.evaluation.rescue_cells import BEST_OF_N, RESCUE, RescueCells, plan, rescue_warnings
from zoomr.evaluation.datasets import Problem
from zoomr.kvstore.events import EventBus
from zoomr.rescue.events import CandidateAborted, CandidateStarted, KVSnapshot, RunStarted
from zoomr.rescue.loop import RescueConfig, RescueLoop
from zoomr.options import RunOptions
from zoomr.rescue.engine import Engine
from zoomr.rescue.plan import RescueOptions
from zoomr.rescue.transcript import Transcript
from zoomr.cli.rescue_view import LiveView
from zoomr.rescue.scorers import HelperLikelihoodScorer
from zoomr.prompts import solve_prompt

from conftest import JANET as QUESTION

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, W = 16, 8  # R-KV budget and headroom buffer: the base holds at most B + W positions after a re-base


class CountingTorch(TorchBackend):
    """The real torch backend over shared weights, recording the tokens handed to every forward."""

    def __init__(self, inner: TorchBackend, cache_factory=None):
        self.__dict__.update(inner.with_cache_factory(cache_factory).__dict__)
        self.prefills: list[tuple[list[int], bool]] = []   # (ids, all_logits)
        self.decodes = 0

    def prefill(self, seq, ids, all_logits=False):
        self.prefills.append((list(ids), all_logits))
        return super().prefill(seq, ids, all_logits)

    def decode(self, seq, token):
        self.decodes += 1
        return super().decode(seq, token)

    def decode_batch(self, seqs, tokens, on_device=False):
        self.decodes += len(seqs)   # one token decoded per sequence, as many single decodes would
        return super().decode_batch(seqs, tokens, on_device)


def rkv_cache(backend):
    """R-KV with a small budget and buffer so a short run evicts (same policy class as --policy rkv)."""
    c = backend.cfg
    return PolicyKVCache(RKVPolicy(B, buffer=W), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                         backend.device, backend.kv_dtype)


def resident(backend: TorchBackend, seq) -> int:
    """Positions the torch base will attend from its next forward on (most over layers). A fork applies
    the policy's pending selection to the parent (``ResidentActiveSet.fork``), so probe with one."""
    backend.free(backend.fork(seq))
    return max(seq.cache.positions(layer).shape[1] for layer in range(backend.cfg.n_layers))


def prompt(backend) -> list[int]:
    return solve_prompt(backend.tokenizer, QUESTION)


class FavouringSource:
    """The shipped fallback scorer plus a bonus for the source this test names for each step, so which source
    wins is chosen by the test rather than left to a seed's luck; every score is still computed by the real
    :class:`HelperLikelihoodScorer` on the real models."""

    def __init__(self, order: tuple[str, ...]):
        self.inner, self.order = HelperLikelihoodScorer(), order
        self.name = self.inner.name

    def score(self, ctx, cand) -> float:
        favoured = self.order[len(ctx.steps) % len(self.order)]
        return self.inner.score(ctx, cand) + (1e3 if cand.source == favoured else 0.0)


def make_loop(base, helper, nb, nh, step_tokens, max_steps, seed=0, scorer=None) -> tuple[RescueLoop, Transcript]:
    """A loop with the fallback scorer (or ``scorer``) and a transcript subscribed (subscribe more on
    ``loop.events``)."""
    events, tr = EventBus(), Transcript()
    events.subscribe(tr)
    loop = RescueLoop(Engine("base", base), Engine("helper", helper), scorer or HelperLikelihoodScorer(),
                      Sampler(SamplingParams(0.8, 20, 0.95, seed)), RescueConfig(nb, nh, step_tokens, max_steps, 2048),
                      events)
    return loop, tr


def run(loop: RescueLoop) -> tuple[list[int], str]:
    """Run on QUESTION and free both states; returns (base prompt ids, stop reason)."""
    ids = prompt(loop.base.backend)
    try:
        return ids, loop.run(QUESTION, ids, prompt(loop.helper.backend))
    finally:
        loop.close()


def committed_ids(tr: Transcript) -> list[list[int]]:
    """Token ids of each committed step, read back from the token events."""
    won = [(e["step"], e["cand"]) for e in tr.events if e["event"] == "step_committed"]
    return [[e["token"] for e in tr.events if e["event"] == "token" and (e["step"], e["cand"]) == w] for w in won]


def test_base_wins_nothing_of_the_history_is_prefilled_again(torch_backend):
    """--nh 0 (eviction-only best-of-N): every commit is a base fork, adopted as the new base state."""
    base, helper = CountingTorch(torch_backend, rkv_cache), CountingTorch(torch_backend)
    view = LiveView(Console(file=io.StringIO(), width=160, record=True))
    loop, tr = make_loop(base, helper, 2, 0, 6, 2)
    loop.events.subscribe(view)
    ids, reason = run(loop)
    s = tr.summary()
    assert reason in ("max_steps", "eos") and s["steps"] and {st["source"] for st in s["steps"]} == {"base"}
    assert base.prefills == [(ids, False)]                      # the prompt, once: never the history again
    assert base.decodes == s["base_tokens"] - s["aborted"]      # each sampled token decoded once (not an abort's last)
    assert s["helper_tokens"] == 0 and s["candidates"] == {"base": 2 * len(s["steps"]), "helper": 0}
    # the helper follows: after its prompt, each committed step is prefilled exactly once (scoring forks aside)
    followed = [p for p, all_logits in helper.prefills if not all_logits]
    assert followed[1:] == committed_ids(tr)
    assert s["kv"]["helper"]["full_tokens"] == len(followed[0]) + sum(st["tokens"] for st in s["steps"])
    # the live view rendered the same facts
    view.console.print(view)
    text = view.console.export_text()
    assert f"▌ step 1 · base · score {s['steps'][0]['score']:.3f}" in text and "KV-Rescue · step" in text
    assert "committed" in text and "helper mean log-likelihood" in text


@pytest.mark.slow
def test_helper_wins_base_prefills_exactly_the_step_and_evicts_back(torch_backend):
    """--nb 0: every step comes from the helper; the evicted base only ever prefills committed steps."""
    base, helper = CountingTorch(torch_backend, rkv_cache), CountingTorch(torch_backend)
    loop, tr = make_loop(base, helper, 0, 1, 10, 3)
    after: list[int] = []
    loop.events.subscribe(lambda ev: after.append(resident(base, loop.base.seq))
                          if isinstance(ev, KVSnapshot) and ev.role == "base" else None)
    ids, _ = run(loop)
    s = tr.summary()
    steps = committed_ids(tr)
    assert len(steps) == len(s["steps"]) >= 2 and {st["source"] for st in s["steps"]} == {"helper"}
    assert base.prefills == [(ids, False)] + [(step, False) for step in steps if step]
    assert base.decodes == 0 and s["base_tokens"] == 0
    assert len(ids) > B + W and all(n <= B + W for n in after), after   # evicted back within B + w
    assert s["kv"]["base"]["full_tokens"] == len(ids) + sum(map(len, steps))
    assert s["prefill_tokens"]["base"] == len(ids) + sum(map(len, steps))


@pytest.fixture(scope="module")
def llama_base():
    from zoomr.backends.llamacpp.engine import LlamaCppBackend

    b = LlamaCppBackend(resolve_model(None), n_ctx=2048, threads=1, policy="streaming", budget=B, window=4)
    yield b
    b.close()


@pytest.mark.slow
def test_llamacpp_base_counts_every_submitted_token(llama_base, torch_backend):
    """Both sources win: llama.cpp's own counter equals prompt + base samples + helper-won steps."""
    before = llama_base.tokens_submitted
    cap = B + 4
    order = ("helper", "base", "helper")  # a base step decoded on top of a prefilled helper step, and back
    loop, tr = make_loop(llama_base, torch_backend, 1, 1, 8, 3, scorer=FavouringSource(order))
    seen = []
    loop.events.subscribe(lambda ev: seen.append(ev.stats) if isinstance(ev, KVSnapshot) and ev.role == "base" else None)
    ids, _ = run(loop)
    s = tr.summary()
    assert tuple(st["source"] for st in s["steps"]) == order[:len(s["steps"])] and len(s["steps"]) >= 2, s["steps"]
    helper_steps = [step for step, st in zip(committed_ids(tr), s["steps"]) if st["source"] == "helper"]
    want = len(ids) + (s["base_tokens"] - s["aborted"]) + sum(map(len, helper_steps))
    assert llama_base.tokens_submitted - before == want
    assert seen and all(kv["active_tokens"] <= cap and kv["llama_cells"] == kv["active_tokens"] for kv in seen)
    assert seen[-1]["full_tokens"] == len(ids) + sum(st["tokens"] for st in s["steps"])


@pytest.mark.slow
def test_ctrl_c_mid_candidate_keeps_the_commits_and_frees_every_fork(llama_base):
    """A KeyboardInterrupt while step 2 samples: the loop ends 'interrupted', step 1 stays, no fork leaks."""
    from zoomr.backends.llamacpp.engine import LlamaCppBackend

    helper = LlamaCppBackend(resolve_model(None), n_ctx=2048, threads=1)
    free_before = len(llama_base._free_ids), len(helper._free_ids)

    def interrupt(ev):
        if ev.kind == "token" and ev.step == 1 and ev.n == 3:
            raise KeyboardInterrupt

    try:
        loop, tr = make_loop(llama_base, helper, 1, 1, 6, 5)
        loop.events.subscribe(interrupt)
        _, reason = run(loop)
        assert reason == "interrupted" and tr.summary()["stop_reason"] == "interrupted"
        assert len(tr.summary()["steps"]) == 1
        assert (len(llama_base._free_ids), len(helper._free_ids)) == free_before   # committed states closed too
    finally:
        helper.close()


def test_nothing_to_commit_is_refused():
    with pytest.raises(ValueError, match="--nb 0 --nh 0"):
        RescueConfig(0, 0).validate()
    with pytest.raises(ValueError, match="--step-tokens"):
        RescueConfig(step_tokens=0).validate()


def test_live_view_shows_an_abort_with_its_reason_and_values():
    view = LiveView(Console(file=io.StringIO(), width=160, record=True))
    view(RunStarted("q", "base-model", "helper-model", "scorer-x", {"detector": {"max_entropy": 7.0}}, {}))
    view(CandidateStarted(0, 0, "base"))
    view(CandidateAborted(0, 0, "base", "entropy", 24, {"mean_entropy": 9.87, "min_gzip_ratio": 0.6}, "#@!"))
    view.console.print(view)
    assert "✗ entropy 9.87 > 7.0 nats" in view.console.export_text()
    view(CandidateStarted(0, 1, "base"))
    view(CandidateAborted(0, 1, "base", "cycle", 300, {"repeat_chars": 260, "period": 470, "copies": 0}, "So"))
    view(CandidateStarted(0, 2, "base"))
    view(CandidateAborted(0, 2, "base", "cycle", 200, {"repeat_chars": 0, "period": 0, "copies": 64}, "1, 2"))
    view.console.print(view)
    text = view.console.export_text()
    assert "cycle: 260 characters repeat every 470" in text and "cycle: 64 copies of one unit" in text


@pytest.mark.slow
def test_trajectory_kv_is_a_per_token_time_average(torch_backend):
    """Each committed token is one sample, at the forward that wrote its KV: a model's own token at its decode
    step, the other model's step at the prefill that took it in (full KV makes both exact to predict)."""
    # --nb 1 --nh 0, both full KV: the base samples every token, the helper prefills every step
    loop, tr = make_loop(torch_backend, torch_backend, 1, 0, 6, 3)
    ids, _ = run(loop)
    s = tr.summary()
    sizes = [st["tokens"] for st in s["steps"]]
    n = sum(sizes)
    base, helper = s["kv_trajectory"]["base"], s["kv_trajectory"]["helper"]
    assert n >= 2 and base["tokens"] == helper["tokens"] == n
    assert base["mean_active_tokens"] == round(len(ids) + (n + 1) / 2, 2)   # token i's decode: prompt + i + 1
    assert base["mean_active_bytes"] == base["mean_full_bytes"]                # full KV: active is full
    ends = [len(ids) + sum(sizes[:i + 1]) for i in range(len(sizes))]         # helper's length after each prefill
    assert helper["mean_active_tokens"] == round(sum(e * k for e, k in zip(ends, sizes)) / n, 2)

    # --nb 0: the evicting base only prefills helper steps, each at the snapshot that followed it
    base_rkv = CountingTorch(torch_backend, rkv_cache)
    loop, tr = make_loop(base_rkv, torch_backend, 0, 1, 6, 3)
    ids, _ = run(loop)
    s = tr.summary()
    sizes = [st["tokens"] for st in s["steps"]]
    n = sum(sizes)
    snaps = [e["stats"] for e in tr.events if e["event"] == "kv" and e["role"] == "base"]
    assert s["kv_trajectory"]["helper"]["mean_active_tokens"] == round(len(prompt(torch_backend)) + (n + 1) / 2, 2)
    assert s["kv_trajectory"]["base"]["mean_active_tokens"] == round(
        sum(k["active_tokens"] * m for k, m in zip(snaps, sizes)) / n, 2)
    assert s["kv_trajectory"]["base"]["mean_active_tokens"] < len(ids)        # evicted below its own prompt


def bench_cells(base, **flags) -> tuple[RescueCells, Problem, list[int]]:
    """The bench's rescue cells over the session's torch backend, with ``--rescue`` flags ``flags``."""
    opts = RunOptions(ctx_size=base.n_ctx, device="cpu", dtype="fp32", top_k=20, knobs={"budget": B})
    rplan, _ = plan(RescueOptions(rescue=True, **flags), opts)
    problem = Problem("0", QUESTION, "18")
    return RescueCells(base, opts, rplan), problem, solve_prompt(base.tokenizer, problem.question)


@pytest.mark.slow
def test_best_of_n_cell_has_no_early_exit_and_both_cells_count_the_helpers_kv(torch_backend):
    """A detector that aborts every base candidate at its first token (entropy > 0 from token 1): the rescue
    cell aborts them all, best-of-N (the paper's baseline) aborts none. Memory: helper KV in the total."""
    cells, problem, ids = bench_cells(torch_backend, nb=1, nh=1, step_tokens=5, max_steps=2, abort_entropy=0.0,
                                      entropy_guard=0)
    bon = cells.run(BEST_OF_N, B, problem, ids, 10)
    res = cells.run(RESCUE, B, problem, ids, 10)
    assert bon["early_exit"] is False and bon["aborted"] == 0 and bon["candidates"] == {"base": bon["steps"],
                                                                                         "helper": 0}
    assert res["early_exit"] is True and res["aborted"] == res["candidates"]["base"] == res["steps"] > 0
    assert res["helper_share"] == 1.0 and res["base_tokens"] == res["aborted"]   # each abort after one token
    for rec in (bon, res):
        assert rec["scorer"] == f"likelihood:{torch_backend.source.path}" and rec["helper_is_base"] is True
        assert rec["prm_kv_bytes_peak"] == 0
        # the likelihood scorer runs on the helper, so even best-of-N holds the helper's KV
        assert 0 < rec["helper_kv_bytes_mean"] <= rec["helper_kv_bytes_peak"]
        # the base's R-KV keeps its query window on the device: counted with its K/V
        assert 0 < rec["mean_policy_state_bytes"] <= rec["policy_state_bytes"]
        assert rec["method_kv_bytes_mean"] == (rec["mean_active_bytes"] + rec["mean_policy_state_bytes"]
                                               + rec["helper_kv_bytes_mean"])
        assert rec["method_kv_bytes_peak"] >= rec["method_kv_bytes_mean"]
        assert rec["saving"] == round(rec["mean_full_bytes"] / rec["method_kv_bytes_mean"], 3)
        assert rec["saving"] < rec["mean_full_bytes"] / rec["mean_active_bytes"]   # not credited for the helper
        assert rec["tokens_generated"] <= 10 and "degenerate" not in rec and isinstance(rec["no_answer_at_cap"], bool)
    assert rescue_warnings([{"policy": BEST_OF_N, **bon}, {"policy": RESCUE, **res}]) == [
        "rescue cells scored by the helper's likelihood with the helper = the base model: the comparison proves "
        "little (give --helper a smaller model and --prm a process reward model)"]


def test_rescue_warnings_name_each_weak_setting_once():
    def rec(policy, scorer, helper_is_base):
        return {"policy": policy, "scorer": scorer, "helper_is_base": helper_is_base}

    fine = [rec(RESCUE, "prm:/m/prm", False), rec(BEST_OF_N, "prm:/m/prm", False),
            rec("full", "likelihood:/m/a", True)]   # a single-sample cell is never read
    assert rescue_warnings(fine) == []
    (line,) = rescue_warnings(fine + [rec(RESCUE, "likelihood:/m/small", False)] * 2)
    assert "not a process reward" in line
    (line,) = rescue_warnings([rec(RESCUE, "prm:/m/prm", True)])
    assert "helper is the base model itself" in line
    lines = rescue_warnings([rec(BEST_OF_N, "likelihood:/m/base", True), rec(RESCUE, "prm:/m/prm", True)])
    assert len(lines) == 2 and "proves little" in lines[0] and "itself" in lines[1]
