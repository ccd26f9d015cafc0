"""Bench plots, their statistics, and run provenance: numbers against published / independently computed values,
PNGs drawn from constructed records, the model's sha256 against hashlib, git state from real repositories."""

import hashlib
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from zoomr.backends.models import embedded_gguf
from zoomr.evaluation.plots import FALLBACK_COLOURS, log_scale, policy_colour, trace_problem, write_plots
from zoomr.evaluation.stats import bootstrap_mean_interval, cell_intervals, wilson_interval
from zoomr.evaluation.provenance import PACKAGES, git_state, model_fingerprint, run_provenance

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
META = {"model": "smollm2-135m", "dataset": "gsm8k", "problems": 3, "n_predict": 64}


# ---------- statistics ----------

@pytest.mark.parametrize("k,n,lo,hi", [
    # Newcombe (1998), Stat. Med. 17:857, Table I, method 3 (Wilson score, no continuity correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_matches_newcombe_table(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_edges_and_bad_input():
    # closed form at 0/n: upper end z²/(n + z²); symmetric at n/n
    z2 = 1.959963984540054 ** 2
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert wilson_interval(10, 10) == pytest.approx((1 - z2 / (10 + z2), 1.0))
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and lo < 0.5 < hi
    for k, n in ((1, 0), (-1, 3), (4, 3)):
        with pytest.raises(ValueError):
            wilson_interval(k, n)


def test_bootstrap_matches_the_exact_bootstrap_distribution():
    values = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    # the exact bootstrap: all 5^5 equally likely resamples
    exact = np.quantile([values[list(i)].mean() for i in itertools.product(range(5), repeat=5)], [0.025, 0.975])
    lo, hi = bootstrap_mean_interval(values)
    assert lo == pytest.approx(exact[0], abs=0.25) and hi == pytest.approx(exact[1], abs=0.25)


def test_bootstrap_is_seeded_and_near_the_normal_interval_for_many_values():
    x = np.random.default_rng(7).normal(3.0, 2.0, size=400)
    a, b = bootstrap_mean_interval(x), bootstrap_mean_interval(x)
    assert a == b  # the same bars on every redraw
    assert bootstrap_mean_interval(x, seed=1) != a
    half = 1.96 * x.std(ddof=1) / np.sqrt(x.size)
    assert a[0] == pytest.approx(x.mean() - half, abs=0.1 * half)
    assert a[1] == pytest.approx(x.mean() + half, abs=0.1 * half)
    assert bootstrap_mean_interval([4.5, 4.5, 4.5]) == (4.5, 4.5)
    with pytest.raises(ValueError):
        bootstrap_mean_interval([])


def test_cell_intervals_group_by_cell_and_skip_single_problems():
    recs = [_rec(f"p{i}", "rkv", 16, correct=i != 0, top1=0.9 + 0.02 * i, kl=None if i == 3 else 0.1 * i)
            for i in range(4)] + [_rec("p0", "zoomr", None, correct=True, top1=0.95, kl=0.05)]
    ci = cell_intervals(recs)
    assert ci[("rkv", 16)]["accuracy"] == wilson_interval(3, 4)
    assert ci[("rkv", 16)]["fidelity_kl"] == bootstrap_mean_interval([0.0, 0.1, 0.2])  # None left out
    assert ci[("rkv", 16)]["fidelity_top1"] == bootstrap_mean_interval([0.9, 0.92, 0.94, 0.96])
    assert ci[("zoomr", None)] == {"accuracy": None, "fidelity_top1": None, "fidelity_kl": None,
                                   "mean_active_tokens": None}


# ---------- plots ----------

def _rec(pid, policy, budget, correct=True, top1=None, kl=None, n=64, prompt=40):
    """A record as bench writes it: the active trace grows by one per token and drops at each eviction."""
    if budget is None:
        trace = [[0, prompt], [n, prompt + n]]
    else:  # evict back to the budget every 16 tokens above it
        trace, active = [[0, prompt]], prompt
        for t in range(16, n + 1, 16):
            trace.append([t, active + 16])
            active = min(active + 16, budget + prompt // 2)
            trace.append([t, active])
    mean = float(np.mean([a for _, a in trace]))
    return {"problem_id": pid, "policy": policy, "budget": budget, "correct": correct, "fidelity_top1": top1,
            "fidelity_kl": kl, "mean_active_tokens": mean, "active_trace": trace}


def _records(problems=3):
    rng = np.random.default_rng(0)
    recs = []
    for i in range(problems):
        pid = f"gsm8k-{i}"
        recs.append(_rec(pid, "full", None, correct=bool(i % 2 == 0)))
        for policy in ("sumr", "zoomr"):
            recs.append(_rec(pid, policy, None, correct=bool(rng.random() < 0.6), top1=float(rng.uniform(0.85, 1)),
                             kl=float(rng.uniform(0.01, 0.1))))
        for b in (16, 64):
            for policy in ("streaming", "h2o", "snapkv", "rkv"):
                recs.append(_rec(pid, policy, b, correct=bool(rng.random() < 0.4),
                                 top1=float(rng.uniform(0.6, 0.95)), kl=float(rng.uniform(0.05, 0.8))))
    return recs


def _rows(recs):
    """Summary rows with the new field names, built here from the records (not the code under test)."""
    cells = {}
    for r in recs:
        cells.setdefault((r["policy"], r["budget"]), []).append(r)
    rows = []
    for (policy, budget), rs in cells.items():
        def mean(k):
            v = [r[k] for r in rs if r[k] is not None]
            return float(np.mean(v)) if v else None
        rows.append({"policy": policy, "budget": budget, "problems": len(rs),
                     "accuracy": float(np.mean([r["correct"] for r in rs])), "fidelity_top1": mean("fidelity_top1"),
                     "fidelity_kl": mean("fidelity_kl"), "mean_active_tokens": mean("mean_active_tokens"),
                     "peak_active_tokens": max(a for r in rs for _, a in r["active_trace"])})
    return rows


def _pixels_near(png, hex_colour, tol=0.06):
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).max(axis=-1) < tol).sum())


def test_write_plots_three_pngs_with_bars_and_palette(tmp_path):
    recs = _records()
    paths = write_plots(_rows(recs), recs, tmp_path, META)
    assert [p.name for p in paths] == ["accuracy_vs_kv.png", "fidelity_vs_kv.png", "active_kv_vs_generated.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    h, w = matplotlib.image.imread(paths[1]).shape[:2]
    assert w > 1.8 * h  # two panels side by side: top-1 and KL
    # every policy is drawn in its own fixed colour, in every figure it appears in
    for p in paths:
        assert _pixels_near(p, policy_colour("zoomr")) > 20 and _pixels_near(p, policy_colour("rkv")) > 20


@pytest.mark.slow
def test_palette_colour_follows_the_policy_not_the_run(tmp_path):
    recs = [r for r in _records() if r["policy"] in ("full", "rkv")]
    (tmp_path / "a").mkdir()
    write_plots(_rows(recs), recs, tmp_path / "a", META)
    # zoomr's colour is absent when zoomr did not run, and rkv keeps its colour with fewer policies around
    png = tmp_path / "a" / "accuracy_vs_kv.png"
    assert _pixels_near(png, policy_colour("zoomr")) == 0 and _pixels_near(png, policy_colour("rkv")) > 20
    known = ["full", "streaming", "h2o", "snapkv", "rkv", "keydiff", "sumr", "zoomr", "rescue", "best-of-n"]
    assert len({policy_colour(p) for p in known}) == len(known)
    assert policy_colour("my-policy") in FALLBACK_COLOURS
    # the fallback does not depend on the process's string-hash seed; importing the module loads no matplotlib
    code = ("import sys; from zoomr.evaluation.plots import policy_colour; "
            "print(policy_colour('my-policy'), 'matplotlib' in sys.modules)")
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                           env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)})
        assert r.stdout.split() == [policy_colour("my-policy"), "False"]


def test_write_plots_single_problem_no_fidelity_no_trace(tmp_path):
    recs = [{**r, "fidelity_top1": None, "fidelity_kl": None} for r in _records(1)]
    rows = _rows(recs)
    recs = [{**r, "active_trace": []} for r in recs]
    paths = write_plots(rows, recs, tmp_path, {**META, "problems": 1})
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)


def test_log_axis_only_for_wide_ranges():
    assert not log_scale([40.0, 100.0, 300.0])  # 7.5×: linear
    assert log_scale([20.0, 1000.0])
    assert not log_scale([0.0, 5.0])  # KL of 0 cannot sit on a log axis
    assert not log_scale([])


def test_trace_problem_prefers_one_every_cell_ran():
    recs = _records(3)
    # p0 lost its zoomr cell (interrupted run): p1 is the first problem with every cell
    recs = [r for r in recs if not (r["problem_id"] == "gsm8k-0" and r["policy"] == "zoomr")]
    pid, drawn = trace_problem(recs)
    assert pid == "gsm8k-1"
    assert len(drawn) == len({(r["policy"], r["budget"]) for r in recs}) and {r["problem_id"] for r in drawn} == {pid}
    only_some = [r for r in recs if r["problem_id"] == "gsm8k-0"]
    assert trace_problem(only_some)[0] == "gsm8k-0"
    assert trace_problem([{**r, "active_trace": []} for r in recs]) == (None, [])


# ---------- provenance ----------

def test_provenance_of_the_embedded_model():
    prov = run_provenance(None)
    path = embedded_gguf()
    with open(path, "rb") as f:
        assert prov["model_sha256"] == hashlib.file_digest(f, "sha256").hexdigest()
    assert prov["model_bytes"] == path.stat().st_size and prov["model_path"] == str(path)
    assert prov["zoomr_version"] and isinstance(prov["zoomr_version"], str)
    assert set(prov["packages"]) == set(PACKAGES)
    assert all(isinstance(v, str) and v[0].isdigit() for v in prov["packages"].values()), prov["packages"]
    json.dumps(prov)  # goes into config.json as is
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert prov["git_commit"] == head and isinstance(prov["git_dirty"], bool)


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_git_state_only_for_a_checkout_that_tracks_the_source(tmp_path):
    src = tmp_path / "plain" / "pkg.py"
    src.parent.mkdir()
    src.write_text("x = 1\n")
    assert git_state(src) == (None, None)  # not a git folder
    repo = tmp_path / "repo"
    (repo / "venv").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-qm", "a")
    installed = repo / "venv" / "pkg.py"  # a package installed into a venv inside someone else's repository
    installed.write_text("x = 1\n")
    assert git_state(installed) == (None, None)
    _git(repo, "add", "venv/pkg.py")
    _git(repo, "commit", "-qm", "pkg")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_state(installed) == (head, False)
    installed.write_text("x = 2\n")
    assert git_state(installed) == (head, True)


def test_fingerprint_of_a_hf_directory_and_of_a_hub_id(tmp_path):
    files = {"config.json": b"{}", "model.safetensors": bytes(range(256)) * 5000, "tokenizer.json": b'{"v": 1}'}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "README.md").write_text("not read by loading, not hashed")
    fp = model_fingerprint(tmp_path)
    digests = {n: hashlib.sha256(d).hexdigest() for n, d in sorted(files.items())}
    assert fp["model_files"] == digests
    # the sha256sum listing of the sorted files, hashed
    listing = "".join(f"{d}  {n}\n" for n, d in digests.items()).encode()
    assert fp["model_sha256"] == hashlib.sha256(listing).hexdigest()
    assert fp["model_bytes"] == sum(map(len, files.values()))
    prov = run_provenance("HuggingFaceTB/not-a-local-path")
    assert prov["model_sha256"] is None and prov["model_bytes"] is None
