"""``zoomr bench --no-live`` as read by a person: the header names every policy, counts agree in number,
and a policy without a budget shows ``B=-``."""

import pytest

from conftest import zoomr


@pytest.mark.slow
def test_plain_bench_header_counts_and_budget_column(tmp_path):
    out = tmp_path / "b"
    args = ["bench", "--dataset", "gsm8k", "--limit", "1", "-n", "2", "--budget", "16", "--policies",
            "full,streaming", "--no-fidelity", "--no-live", "--out", str(out)]
    r = zoomr(*args)
    assert r.returncode == 0, r.stderr
    header = next(l for l in r.stderr.splitlines() if "gsm8k:" in l)
    assert "policies full, streaming" in header and "KV policy" not in header, header
    assert "gsm8k: 1 problem ·" in header, header
    cells = [l for l in r.stdout.splitlines() if not l.startswith("{")]
    assert [l.split()[1:3] for l in cells] == [["full", "B=-"], ["streaming", "B=16"]], cells
    assert "None" not in r.stdout.replace('"budget": null', "")

    again = zoomr(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert f"gsm8k: every cell of 1 problem is already in {out}" in again.stderr
