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
