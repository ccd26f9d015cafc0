"""SumR/ZoomR on their segments: the open segment stays whole, content-only summary means, AG only where
it says something, and §3.5's memory-saving formula."""

import numpy as np
import pytest

from zoomr.kvstore.segments import BEGIN, END
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy, memory_saving_formula
from policy_drive import drive

N_PROMPT = 5


@pytest.mark.parametrize("make", [lambda: ZoomRPolicy(4, 2, 1, "model"), lambda: SumRPolicy(4, "model")])
def test_the_segment_being_written_and_its_summary_stay_whole(make):
    # one 16-token regular segment (a sentence end every 4 tokens), then its summary being written:
    # a 4-token window alone would drop most of it at every recompute
    texts = (["a"] * 3 + ["."]) * 4 + [BEGIN, " s", "."]
    policy = make()
    _, attended, _, _ = drive(policy, texts, N_PROMPT)
    assert policy.tracker.in_summary and policy.recomputes >= 4
    for f in range(1, len(texts) + 1):
        for layer in attended[f]:
            for row in layer:
                assert row == list(range(N_PROMPT + f)), f"forward {f}"


def test_the_window_still_slides_past_a_closed_segment():
    texts = (["a"] * 3 + ["."]) * 3 + [BEGIN, "s", END] + ["b", "."] * 4
    policy = ZoomRPolicy(4, 1, 0, "model")              # c = 0: nothing is ever zoomed in
    _, attended, _, _ = drive(policy, texts, N_PROMPT)
    (seg,) = policy.tracker.segments
    last = set(attended[-1][0][0])
    assert not set(seg.regular) & last and set(seg.summary) <= last


def test_prompted_summary_mean_key_averages_its_content_tokens_only():
    texts = ["We", " add", ".", " <|begin", "_of_sum", "mary|>", " two", " things", " <|end_of", "_summary|>", "x"]
    policy = ZoomRPolicy(4, 1, 1, "prompted")
    _, _, _, k = drive(policy, texts, N_PROMPT, seed=2)
    (seg,) = policy.tracker.segments
    content = [N_PROMPT + 6, N_PROMPT + 7]
    assert list(seg.key_positions) == content
    got = policy.mean_keys[:, :, 0].double().numpy()                       # [L, Hkv, d]
    assert np.allclose(got, k[:, :, content].mean(axis=2), atol=1e-6)
    assert not np.allclose(got, k[:, :, list(seg.summary)].mean(axis=2), atol=1e-3)


def paragraphs(n):
    return ["w", "w", "\n\n"] * n


def test_papers_ag_at_every_recompute_and_the_selections_beside_it():
    # segment_tokens 6: blocks close at "\n\n" from 2 tokens, so each 3-token paragraph is one segment;
    # a 1-token window leaves every closed segment a candidate
    policy = ZoomRPolicy(1, 2, 2, "auto", segment_tokens=6)
    drive(policy, paragraphs(2) + ["w", "."] * 2, N_PROMPT)
    assert len(policy.tracker.segments) == 2 and policy.recomputes == 4
    # the paper's AG (§4) is recorded at every recompute: with N_t = 2 ≤ c every vote is in I_c
    assert policy.ag == [1.0] * 4 and policy.stats()["ag_mean"] == 1.0 and policy.stats()["ag_recomputes"] == 4
    # the selection's own AG skips recomputes with at most max(c, k) candidates (fixed by construction)
    stats = policy.stats()
    assert policy.ag_candidates == [] and stats["ag_candidates_mean"] is None and stats["ag_candidates_recomputes"] == 0
    policy = ZoomRPolicy(1, 2, 2, "auto", segment_tokens=6)
    drive(policy, paragraphs(5) + ["w", "."] * 2, N_PROMPT, seed=1)
    # the recomputes after the 3rd, 4th and 5th paragraph and at the 2 sentence ends count for the selection's
    assert len(policy.ag_candidates) == 5 and all(0 < a <= 1 for a in policy.ag_candidates)
    assert policy.stats()["ag_candidates_recomputes"] == 5
    # the paper's: every recompute with a closed segment (each paragraph's and the 2 sentence ends)
    assert policy.stats()["ag_recomputes"] == policy.recomputes == 7 and all(0 < a <= 1 for a in policy.ag)
    assert policy.ag[:2] == [1.0, 1.0]   # N_t ≤ c


def test_memory_saving_formula_matches_the_papers_examples():
    assert memory_saving_formula(512, 16384, 2, 250, 20, 80, 512) == pytest.approx(5.48, abs=0.005)
    assert memory_saving_formula(512, 32768, 2, 250, 20, 160, 512) == pytest.approx(7.11, abs=0.005)
    # fewer voted than c: only those are zoomed in
    assert memory_saving_formula(10, 90, 2, 30, 5, 1, 20) == pytest.approx(100 / 60)
    with pytest.raises(ValueError):
        memory_saving_formula(-1, 10, 2, 3, 1, 1, 1)
    with pytest.raises(ValueError):
        memory_saving_formula(0, 10, 2, 3, 1, 0, 0)


def test_zoomr_reports_the_formula_on_its_own_measured_lengths():
    policy = ZoomRPolicy(8, 2, 2, "auto", segment_tokens=6)
    texts = paragraphs(6) + ["w", "."]
    drive(policy, texts, N_PROMPT)
    st = policy.stats()
    inputs = st["formula_inputs"]
    assert inputs == {"n_prompt": N_PROMPT, "n_generated": len(texts), "consensus": 2, "mean_regular": 3.0,
                      "mean_summary": 3.0, "n_voted": policy.voted_last, "window": 8}
    assert st["saving_formula"] == pytest.approx(memory_saving_formula(**inputs), abs=1e-3)


def test_the_formula_counts_only_the_filled_part_of_the_window_in_a_short_run():
    policy = ZoomRPolicy(64, 2, 2, "auto", segment_tokens=6)
    texts = paragraphs(4)
    drive(policy, texts, N_PROMPT)
    assert policy.stats()["formula_inputs"]["window"] == len(texts)     # 12 generated < w = 64


def test_only_segments_that_start_before_the_window_are_voted_and_zoomed():
    # 3-token paragraphs and an 8-token window: the newest segments lie inside the window, where zooming
    # them in would add nothing; the votes and the c zoomed slots go to older ones
    policy = ZoomRPolicy(8, 2, 2, "auto", segment_tokens=6)
    seen, choose = [], policy.choose

    def spy(recent):
        zoomed, summarized, votes = choose(recent)
        seen.append((recent, policy.end, list(policy.tracker.segments), zoomed, votes))
        return zoomed, summarized, votes

    policy.choose = spy
    drive(policy, paragraphs(8) + ["w", "."] * 2, N_PROMPT, seed=4)
    assert len(seen) >= 8
    inside_seen = 0
    for recent, end, segs, zoomed, votes in seen:
        assert recent >= end - 8 - 6 and recent >= N_PROMPT   # the window, or the open segment's start
        inside = {i for i, s in enumerate(segs) if s.first >= recent}
        inside_seen += bool(inside)
        assert not inside & set(votes) and not inside & set(zoomed), (recent, inside, votes)
        outside = len(segs) - len(inside)
        assert len(zoomed) == min(2, outside)   # with k = 2 every candidate past the first two gets votes
    assert inside_seen >= 5   # the case arose: closed segments inside the window were passed over


@pytest.mark.parametrize("make", [lambda: ZoomRPolicy(8, 2, 1, "auto", segment_tokens=12),
                                  lambda: SumRPolicy(8, "auto", segment_tokens=12)])
def test_text_without_boundaries_still_recomputes_every_segment_tokens(make):
    # no sentence end, no line break: before, nothing was ever re-selected and every token stayed active
    texts = ["w"] * 144
    policy = make()
    _, attended, _, _ = drive(policy, texts, N_PROMPT)
    assert policy.recomputes == 144 // 12
    sizes = [len(a[0][0]) for a in attended[1:]]
    # at most: prompt, window, the open block, one block zoomed in, the 4-token stand-ins of the 12 closed
    # blocks, and the tokens written since the last recompute
    bound = N_PROMPT + 8 + 12 + 12 + 4 * 12 + 12
    assert max(sizes) <= bound < N_PROMPT + 144


def test_llamacpp_sumr_evicts_after_segment_tokens_without_a_boundary():
    from zoomr.backends.llamacpp.sumr import SumRCells

    cells = SumRCells(n_ctx=256, window=8, segment_tokens=6)
    assert cells.observe(0, list(range(N_PROMPT)), "prompt") is False
    due = [cells.observe(N_PROMPT + i, [1], "w") for i in range(30)]
    assert [i for i, d in enumerate(due) if d] == [5, 11, 17, 23, 29]
    cells = SumRCells(n_ctx=256, window=8, segment_tokens=6)
    cells.observe(0, list(range(N_PROMPT)), "prompt")
    due = [cells.observe(N_PROMPT + i, [1], t) for i, t in enumerate(["w", "w", ".", "w", "w", "w", "w", "w"])]
    assert due == [False, False, True, False, False, False, False, False]   # a boundary restarts the count
    assert cells.observe(N_PROMPT + 8, [1], "w") is True                     # 6 tokens after it


def test_a_fork_counts_tokens_to_its_next_recompute_on_its_own_clock():
    parent = ZoomRPolicy(8, 2, 1, "auto", segment_tokens=12)
    cache, _, _, _ = drive(parent, ["w"] * 7, N_PROMPT)     # 7 of the 12 tokens towards the next recompute
    child = parent.fork(cache.ctx)
    assert child.clock is not parent.clock and child.clock.last == parent.clock.last == N_PROMPT
    assert child.clock.due("w" * 5, N_PROMPT + 12)           # the child reaches 12 tokens and re-selects
    assert child.clock.last == N_PROMPT + 12 and parent.clock.last == N_PROMPT and parent.clock.tail == "w" * 7
