"""R-KV and SnapKV compress when their references do (issue 47), on fixed seeded tensors.

A 200-token prompt and 300 decode steps at B = 64, the policies' default knobs. The rule each forward is
checked against is written from the references' descriptions (test_policies_reference: ``rkv_schedule``,
``snapkv_schedule`` and the literal kept sets):

* R-KV's runner (rkv/modeling.py, divide_length 128) counts the positions written, prompt included, and
  compresses on the decode step after that count reached a multiple of 128: after 200 prompt tokens, at decode
  steps 57 (256 written before it) and 185 (384), never at the prefill;
* SnapKV compresses the prompt at the prefill when it is longer than B, then runs on R-KV's schedule.
"""

import pytest

from zoomr.evaluation.match import predict_budget
from zoomr.kvstore.registry import PolicySpec
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.snapkv import SnapKVPolicy
from policy_drive import drive, replay
from test_policies_reference import reference, rkv_keep, rkv_schedule, snapkv_keep, snapkv_schedule

# one layer, two query heads sharing one KV head (GQA), head size 4: the literal transcription stays fast
SHAPE = (1, 2, 1, 4)
P, STEPS, B = 200, 300, 64
TEXTS = ["x"] * STEPS


def attended_sizes(policy, ref, n_prompt=P, seed=0):
    """Drive ``policy`` and compare every forward's attended set with ``ref``'s; returns (sizes, attended, cache):
    sizes[f] positions attended by forward f (0: the prefill, k: decode step k), attended[f] those positions."""
    cache, got, q, k = drive(policy, TEXTS, n_prompt, seed, shape=SHAPE)
    want = replay(lambda *a: ref(q, k, *a), n_prompt, TEXTS, n_layers=1, n_kv=1)
    for f, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"forward {f}: attended sets differ"
    return [len(g[0][0]) for g in got], [g[0][0] for g in got], cache


def compressing_steps(sizes):
    """The forwards after which fewer positions are attended than were plus the new token."""
    return [f for f in range(len(sizes) - 1) if sizes[f + 1] < sizes[f] + 1]


def test_rkv_leaves_the_prompt_whole_until_the_decode_step_after_256_written():
    policy = RKVPolicy(B)
    ref = reference(rkv_schedule, rkv_keep, n_layers=1, n_kv=1)(B, policy.window, 128, lam=policy.mix,
                                                                  kernel=policy.kernel)
    sizes, attended, cache = attended_sizes(policy, ref)
    assert compressing_steps(sizes) == [57, 185]
    assert sizes[0] == P and sizes[1] == P + 1 and sizes[56] == 256 and sizes[57] == 257
    assert sizes[58] == B + 1 and sizes[185] == B + 128 and sizes[186] == B + 1
    prompt_kept = [sum(p < P for p in attended[f]) for f in (1, 56, 57, 58, 127, 129)]
    assert prompt_kept[:3] == [P] * 3 and prompt_kept[3] < B and prompt_kept[3] == prompt_kept[4]
    # the bound is the most a decode step attended: the whole prompt's first compression, not B + 128
    st = cache.stats()
    assert st.bound_tokens == 257 == max(sizes[1:]) and st.peak_active_tokens == 257 and not st.bound_measured


def test_snapkv_compresses_the_prompt_at_prefill_then_on_rkvs_schedule():
    policy = SnapKVPolicy(B)
    ref = reference(snapkv_schedule, snapkv_keep, n_layers=1, n_kv=1)(B, policy.window, 128,
                                                                      kernel=policy.kernel)
    sizes, attended, cache = attended_sizes(policy, ref)
    assert compressing_steps(sizes) == [0, 57, 185]
    assert sizes[0] == P and sizes[1] == B + 1 and sizes[57] == B + 57 and sizes[185] == B + 128
    # the prefill's window (the last 32 prompt positions) and B − 32 others chosen among the prompt
    assert sum(p < P for p in attended[1]) == B and set(range(P - policy.window, P)) <= set(attended[1])
    st = cache.stats()
    assert st.bound_tokens == B + 128 == max(sizes[1:])


@pytest.mark.parametrize("make,schedule,keep,knobs", [
    (lambda: SnapKVPolicy(B), snapkv_schedule, snapkv_keep, {"kernel": 5}),
    (lambda: RKVPolicy(B), rkv_schedule, rkv_keep, {"lam": 0.1, "kernel": 7})], ids=["snapkv", "rkv"])
def test_a_prompt_within_the_budget_waits_for_the_schedule(make, schedule, keep, knobs):
    """40 prompt tokens at B = 64: nothing to cut at the prefill; the first compression is decode step 89
    (128 positions written before it), which attends 129 and keeps 64."""
    policy = make()
    ref = reference(schedule, keep, n_layers=1, n_kv=1)(B, policy.window, 128, **knobs)
    sizes, _, _ = attended_sizes(policy, ref, n_prompt=40, seed=1)
    assert sizes[1] == 41 and compressing_steps(sizes) == [89, 217] and sizes[89] == 129 and sizes[90] == B + 1


@pytest.mark.parametrize("name", ["rkv", "snapkv"])
def test_matched_budgets_follow_the_schedule(name):
    """--match-budget's prediction simulates the policy's own schedule: within 2 % of the target with a prompt
    longer than the budget; R-KV's whole-prompt phase is a floor no budget lowers (SnapKV cuts the prompt)."""
    budget, simulated = predict_budget(PolicySpec(name), 300.0, 200, 1000)
    assert abs(simulated / 300.0 - 1) <= 0.02
    budget, simulated = predict_budget(PolicySpec(name), 120.0, 180, 192)
    if name == "rkv":   # steps 1..77 attend 181..257 whatever B is: the mean stays above 120
        assert budget == 9 and simulated > 1.05 * 120
    else:
        assert abs(simulated / 120.0 - 1) <= 0.02
