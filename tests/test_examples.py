"""examples/library.py runs as a user would run it: from another folder, and prints what it promises."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ENV, ROOT


@pytest.mark.slow
def test_library_example_runs_from_any_folder(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "library.py")], capture_output=True, text=True,
                       cwd=tmp_path, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # (a) solve under H2O with B = 32: one position over the budget is attended while a token decodes
    assert "KV policy h2o(B=32" in out and re.search(r"^answer: .+ · stop: (eos|length)", out, re.M)
    mean = re.search(r"^kv: (\d+) positions attended per decode step .* of (\d+) written", out, re.M)
    assert mean and int(mean[1]) <= 33 < int(mean[2])
    # (b) the rescue callback saw candidates start and steps commit, and the summary agrees
    rescue = out.split("== KV-Rescue", 1)[1].split("\n== ", 1)[0]
    commits = re.findall(r"^step (\d) · committed candidate", rescue, re.M)
    assert "started" in rescue and commits == ["0", "1"]
    assert re.search(r"^rescue: 2 steps, .* · stop: max_steps$", rescue, re.M)
    # (c) H2O with B = 8 on random tensors: the prefill is attended whole, then 8 kept + the new token per head
    policy = out.split("on random tensors", 1)[1]
    heads = [json.loads(h) for h in re.findall(r"kv head \d: (\[.*\])", policy)]
    assert len(heads) == 8 and heads[0] == list(range(12))
    for i, kept in enumerate(heads[2:]):
        newest = 12 + i // 2
        assert len(kept) == 9 and kept[-1] == newest and kept == sorted(set(kept))
    assert policy.rstrip().endswith("kv: 9 of 15 positions attended at the last forward")
