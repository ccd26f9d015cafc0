"""Summary rows of ``zoomr bench``: means over a row's records, printed and stored without float noise."""

import json

from zoomr.evaluation.metrics import summarize


def test_means_of_rounded_fields_read_as_written():
    recs = [{"policy": "full", "budget": None, "correct": c, "decode_tok_s": v, "mean_full_bytes": f,
             "mean_active_bytes": a}
            for c, v, f, a in [(True, 1.1, 3.0, 1.0), (False, 2.2, 3.0, 1.0), (False, 6.6, 3.3, 1.0)]]
    row = summarize(recs)[0]
    assert json.dumps(row["decode_tok_s"]) == "3.3"          # np.mean gives 3.3000000000000003
    assert json.dumps(row["saving"]) == "3.1"                # 9.3 / 3.0 gives 3.1000000000000005
    assert row["accuracy"] == 0.333333333 and row["problems"] == 3
    assert row["mean_full_bytes"] == 3.1 and row["mean_active_bytes"] == 1.0   # docs/bench.md's names, in rows too


def test_zoomr_rows_carry_the_formula_summary_rate_and_recomputes():
    def rec(policy, tokens, extra):
        return {"policy": policy, "budget": None, "correct": False, "tokens_generated": tokens, "kv_extra": extra}

    recs = [rec("zoomr", 1000, {"summaries_written": 3, "recomputes": 10, "saving_formula": 2.0}),
            rec("zoomr", 3000, {"summaries_written": 9, "recomputes": 20, "saving_formula": 4.0}),
            rec("sumr", 2000, {"summaries_written": 0, "recomputes": 5}),
            rec("full", 2000, {})]
    by = {r["policy"]: r for r in summarize(recs)}
    # pooled over the row's tokens (12 per 4,000), not a mean of per-run rates
    assert by["zoomr"]["summaries_per_1k_tokens"] == 3.0 and by["zoomr"]["recomputes"] == 15.0
    assert by["zoomr"]["saving_formula"] == 3.0
    assert by["sumr"]["summaries_per_1k_tokens"] == 0.0 and by["sumr"]["saving_formula"] is None
    assert by["full"]["summaries_per_1k_tokens"] is None and by["full"]["recomputes"] is None
