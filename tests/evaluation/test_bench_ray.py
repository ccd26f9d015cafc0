"""``zoomr bench --ray``: the same records as a local run, every cell once when a worker dies, ``--resume`` after
the driver dies, and bad input refused in one line (CI has no cluster: the in-process benches share one 2-CPU
local Ray started by the ``ray_cluster`` fixture, each ``zoomr`` subprocess starts its own with ``--ray auto``)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import zoomr
from conftest import ENV, ROOT, assert_one_line_error, sigint_default, wait_for, zoomr_cmd
from conftest import zoomr as cli
from zoomr.errors import UserError
from zoomr.evaluation import bench_events as ev
from zoomr.evaluation.bench_plan import plan_bench
from zoomr.evaluation.ray_bench import expected_cost, units
from zoomr.evaluation.ray_cluster import check_address
from zoomr.evaluation.records import record_differences, record_key
from zoomr.evaluation.runner import bench_options

pytest.importorskip("ray")   # the test extra installs it; a checkout without it still runs the rest
# one xdist worker runs them all (pytest -n with --dist loadgroup, as pyproject sets): each starts a 2-CPU
# local Ray, and two at once would share the machine's two cores between four workers
pytestmark = pytest.mark.xdist_group("ray")

# greedy fp32, one thread per worker: records equal a local run's field by field
SETTINGS = {"policies": ["full", "rkv"], "budgets": [16], "n_predict": 24, "dtype": "fp32", "threads": 1}
CLI = ["bench", "--policies", "full,rkv", "--budget", "16", "-n", "24", "--dtype", "fp32", "-t", "1", "--no-live"]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _keys(records) -> list:
    return [record_key(r["problem_id"], r["policy"], r["budget"]) for r in records]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Three problems benched in this process: what every Ray run here must reproduce."""
    out = tmp_path_factory.mktemp("local") / "b"
    zoomr.bench(**SETTINGS, limit=3, out=out)
    return _records(out)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray instance (2 CPUs, no dashboard) for this module's in-process Ray benches: a bench run after
    the caller's own ``ray.init`` uses that Ray as it is and leaves it running (``RayBench.start``), so they
    start Ray once, not once each (about 4.5 s of start and shutdown per bench on a 2-core host)."""
    import logging

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_records_equal_a_local_run_and_name_their_worker(tmp_path, local, ray_cluster):
    events = []
    out = tmp_path / "ray"
    result = zoomr.bench(**SETTINGS, limit=3, out=out, ray="auto", ray_workers=2, n_parallel=2,
                         on_event=events.append)
    got = _records(out)
    assert record_differences(local, got) == []   # timings and worker fields aside
    assert result["records"] == got
    config = json.loads((out / "config.json").read_text())
    workers = config["workers"]
    assert len(workers) == 2 and all(w["provenance"]["model_sha256"] for w in workers)
    pids = {w["pid"] for w in workers}
    assert {r["worker_pid"] for r in got} == pids   # both workers ran cells, and each record names its own
    assert all(r["worker_host"] == workers[0]["host"] for r in got)
    started = next(e for e in events if isinstance(e, ev.BenchStarted))
    assert started.model.endswith("· 2 Ray workers")
    assert sum(isinstance(e, ev.Info) and e.text.startswith("ray worker ") for e in events) == 2
    assert ray_cluster.is_initialized()   # a caller's own Ray is left running


@pytest.mark.slow
def test_matched_budget_cells_on_ray_equal_a_local_run(tmp_path, ray_cluster):
    # matched cells need their problem's full-KV reference and ZoomR's record: they stay on one worker
    settings = {"policies": ["full", "rkv", "zoomr"], "match_budget": True, "limit": 2, "n_predict": 24,
                "dtype": "fp32", "threads": 1, "segment_tokens": 16, "window": 8}
    zoomr.bench(**settings, out=tmp_path / "local")
    zoomr.bench(**settings, out=tmp_path / "ray", ray="auto", ray_workers=2)
    local, ray = _records(tmp_path / "local"), _records(tmp_path / "ray")
    assert len(local) == 6 and record_differences(local, ray) == []
    assert sum(r["budget"] == "matched" for r in ray) == 2


@pytest.mark.slow
def test_a_killed_worker_has_its_cells_rerun_elsewhere_and_none_twice(tmp_path, local, ray_cluster):
    killed, events = [], []

    def kill_first_worker(rec):
        # kill -9 the worker that just finished a cell: its problem still has cells in flight there
        if not killed:
            killed.append(rec["worker_pid"])
            os.kill(rec["worker_pid"], signal.SIGKILL)

    out = tmp_path / "ray"
    zoomr.bench(**SETTINGS, limit=3, out=out, ray="auto", ray_workers=2, on_record=kill_first_worker,
                on_event=events.append)
    got = _records(out)
    assert sorted(_keys(got)) == sorted(_keys(local)) and len(set(_keys(got))) == len(got)
    assert record_differences(local, got) == []
    lost = [e.text for e in events if isinstance(e, ev.Warning) and "died" in e.text]
    assert len(lost) == 1 and str(killed[0]) in lost[0]
    survivors = {r["worker_pid"] for r in got} - set(killed)
    assert len(survivors) == 1   # the cells left after the kill ran on the other worker


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_resume_after_the_driver_is_killed_redoes_nothing(tmp_path, local, how):
    out = tmp_path / "ray"
    args = CLI + ["--limit", "3", "--out", str(out), "--ray", "auto", "--ray-workers", "2"]
    proc = subprocess.Popen(zoomr_cmd() + args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    rec_file = out / "records.jsonl"
    wait_for(lambda: rec_file.exists() and rec_file.read_text().count("\n") >= 2, proc, 600, "two records")
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    if how == signal.SIGINT:   # Ctrl-C: the workers are stopped, the finished cells summarized
        assert proc.returncode == 130 and "--resume runs the rest" in err, err
        assert (out / "summary.json").exists()
    before = _records(out)
    assert 2 <= len(before) < len(local)
    r = cli(*args, "--resume", timeout=900)
    assert r.returncode == 0, r.stderr
    got = _records(out)
    assert got[:len(before)] == before   # nothing finished is redone or rewritten
    assert len(set(_keys(got))) == len(got) and sorted(_keys(got)) == sorted(_keys(local))
    assert record_differences(local, got) == []


@pytest.mark.slow
def test_ray_without_the_extra_is_one_line_naming_it(tmp_path):
    # the interpreter as it is without Ray installed: importing it fails
    code = "import sys; sys.modules['ray'] = None; sys.argv[0] = 'zoomr'; from zoomr.cli.app import run; run()"
    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-c", code] + CLI + ["--limit", "1", "--out", str(out), "--ray", "auto"],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert_one_line_error(r)
    assert "pip install 'zoomr[ray]'" in r.stderr and not out.exists()


# 10.255.255.1: nothing listens (refused by the TCP check within 5 s), or, behind a proxy that accepts any
# connection, something that is not Ray answers: Ray's own connection then gives up after about 20 s, so that
# case gets 45 s (the process start included) where CI's load may slow it
@pytest.mark.parametrize("address, seconds", [("127.0.0.1:1", 30), ("no-such-host.invalid:6379", 30),
                                              pytest.param("10.255.255.1:6379", 45, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_bad_address_is_one_line_within_30_seconds(tmp_path, address, seconds):
    out = tmp_path / "b"
    start = time.monotonic()
    r = cli(*CLI, "--limit", "1", "--out", str(out), "--ray", address, timeout=120)
    assert time.monotonic() - start < seconds
    assert_one_line_error(r)
    assert f"--ray {address}: cannot reach a Ray cluster there" in r.stderr and not out.exists()


@pytest.mark.slow
def test_a_port_where_something_else_listens_is_given_up_on_in_25_seconds(tmp_path):
    # an HTTP server passes the TCP check; Ray's own join would retry for minutes
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(server.stdout.readline().split(" port ")[1].split()[0])
        start = time.monotonic()
        r = cli(*CLI, "--limit", "1", "--out", str(tmp_path / "b"), "--ray", f"127.0.0.1:{port}", timeout=180)
        assert time.monotonic() - start < 60
        assert_one_line_error(r)
        assert "no Ray cluster answered there within 25 s" in r.stderr and not (tmp_path / "b").exists()
    finally:
        server.kill()


@pytest.mark.parametrize("address", ["localhost", "host:port", "ray://:10001", "h:99999", "http://127.0.0.1:1",
                                     "127.0.0.1:6379:1"])
def test_an_address_without_a_port_is_refused(address):
    with pytest.raises(UserError, match="give auto, HOST:PORT"):
        check_address(address)


@pytest.mark.slow
def test_ray_workers_without_ray_or_below_one_are_refused():
    r = cli(*CLI, "--limit", "1", "--ray-workers", "2")
    assert_one_line_error(r)
    assert "add --ray auto" in r.stderr
    r = cli(*CLI, "--limit", "1", "--ray", "auto", "--ray-workers", "0")
    assert_one_line_error(r)
    assert "--ray-workers must be >= 1" in r.stderr


@pytest.mark.slow
def test_more_workers_than_the_cluster_fits_are_refused_before_any_loads(tmp_path):
    out = tmp_path / "b"
    r = cli(*CLI, "--limit", "1", "--out", str(out), "--ray", "auto", "--ray-workers", str(os.cpu_count() + 1))
    assert_one_line_error(r)
    assert "the Ray cluster has room for" in r.stderr and not out.exists()


def test_longer_problems_and_heavier_cells_are_expected_to_cost_more():
    plan = plan_bench(bench_options(None, {"n_predict": 100}), ["full", "rkv"], [16], dataset="gsm8k", limit=1,
                      out=None, match_budget=False, fidelity=True, n_parallel=1, rescue=None)
    cells = plan.cells
    assert expected_cost(plan, cells, 50) > expected_cost(plan, cells, 10) > expected_cost(plan, cells[:1], 10)
    assert expected_cost(plan, [("rkv", "matched")], 10) == 2 * expected_cost(plan, [("rkv", 16)], 10)


def test_units_fill_a_batch_twice_but_leave_every_worker_one_and_keep_matched_problems_alone():
    def plan_of(n_parallel, policies=("full", "rkv"), match=False):
        return plan_bench(bench_options(None, {}), list(policies), None if match else [16], dataset="gsm8k",
                          limit=8, out=None, match_budget=match, fidelity=True, n_parallel=n_parallel, rescue=None)

    # full + rkv with its fidelity pass: 3 sequences a problem, so 3 problems fill -np 4 twice; 8 problems on
    # 2 workers go as 4 units of 2 (3, 3, 2 would leave one worker a unit behind)
    plan = plan_of(4)
    cost = {p.id: i for i, p in enumerate(plan.problems)}
    got = units(plan, plan.problems, cost, workers=2)
    assert [len(u) for u in got] == [2, 2, 2, 2] and got[0][0].id == plan.problems[-1].id   # most work first
    assert [len(u) for u in units(plan, plan.problems, cost, workers=1)] == [3, 3, 2]
    assert [len(u) for u in units(plan, plan.problems, cost, workers=8)] == [1] * 8
    assert [len(u) for u in units(plan_of(1), plan.problems, cost, workers=2)] == [1] * 8
    matched = plan_of(8, ("full", "rkv", "zoomr"), match=True)
    assert [len(u) for u in units(matched, matched.problems, cost, workers=1)] == [1] * 8


@pytest.mark.slow
def test_bench_help_names_ray_and_its_extra():
    r = cli("bench", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--ray" in text and "--ray-workers" in text and "zoomr[ray]" in text.replace("│ ", "").replace(" │", "")
