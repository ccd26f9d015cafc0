"""Reaching Ray for ``zoomr bench --ray``: importing it (an optional extra), checking the address before Ray's
own long retries, sizing the workers to the cluster, and keeping Ray's log lines off the user's terminal.

Source: Ray's cluster and resource APIs (docs.ray.io: ``ray.init``, ``ray.cluster_resources``, "Starting Ray").
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading

from zoomr.errors import UserError

from zoomr.evaluation.bench_plan import BenchPlan

RAY_EXTRA = "pip install 'zoomr[ray]'"
CONNECT_TIMEOUT_S = 5.0   # a TCP check before ray.init, which waits far longer on an address nobody serves
JOIN_TIMEOUT_S = 25.0     # Ray's own join, where something answers the TCP check: it retries for minutes
LOCAL = "auto"            # --ray auto: start a Ray instance on this machine for this bench


def import_ray():
    """The ``ray`` module. Raises: UserError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray needs Ray, an optional dependency: {RAY_EXTRA}") from None
    return ray


def check_address(address: str) -> str | None:
    """``--ray``'s value checked: None for ``auto``, else the address for ``ray.init`` once a TCP connection to
    it opened (within :data:`CONNECT_TIMEOUT_S` seconds).

    Args:
        address: ``auto``, ``HOST:PORT`` (a head started with ``ray start --head``, port 6379 by default) or
            ``ray://HOST:PORT`` (Ray Client, port 10001).
    Raises:
        UserError: no port, or nothing answers there (the OS's reason named).
    """
    if address == LOCAL:
        return None
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    bare = host.strip("[]")
    if (not host or "://" in hostport or (":" in bare and not host.startswith("["))
            or not port.isdigit() or not 0 < int(port) < 65536):
        raise UserError(f"--ray {address!r}: give auto, HOST:PORT (ray start --head prints it) or ray://HOST:PORT")
    try:
        socket.create_connection((bare, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise UserError(f"--ray {address}: cannot reach a Ray cluster there ({why})") from None
    return address


def connect(ray, address: str | None) -> None:
    """Start a local Ray instance (``address`` None) or join the cluster at ``address``.

    Joining waits at most :data:`JOIN_TIMEOUT_S` seconds: where something that is not Ray listens, Ray's own
    retries last minutes (20 attempts of up to 40 s), so the join runs in a daemon thread that is given up on.
    Raises:
        UserError: Ray's connection gave up or did not answer in time (something listens there, but not Ray),
            in one line: Ray's C++ side logs each retry on stderr, silenced here.
    """
    failed: list[BaseException] = []

    def join() -> None:
        try:
            # log_to_driver off: workers' output would tear the live table; their errors come back as ours
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR, configure_logging=False)
        except BaseException as e:   # handed to the caller's thread
            failed.append(e)

    where = address or "this machine"
    with quiet(), no_stderr():
        if address is None:
            join()
        else:
            thread = threading.Thread(target=join, name="ray-join", daemon=True)
            thread.start()
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                raise UserError(f"--ray {where}: no Ray cluster answered there within {JOIN_TIMEOUT_S:.0f} s "
                                "(something else listens on that port?)")
    if failed:
        e = failed[0]
        if isinstance(e, (ConnectionError, RuntimeError, TimeoutError)):
            raise UserError(f"--ray {where}: cannot reach a Ray cluster there ({first_line(e)})") from None
        raise e


def slots(ray, plan: BenchPlan, workers: int | None) -> tuple[int, dict, int]:
    """How many workers, the resources each asks Ray for, and the CPU threads each decodes with.

    One worker per GPU when the cluster has GPUs and ``--device`` allows CUDA; else one per ``-t`` CPUs
    (``-t`` defaults to 1 thread per worker here).

    Raises:
        UserError: ``workers`` more than fit, or ``--device cuda`` on a cluster without GPUs.
    """
    res = ray.cluster_resources()
    cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
    device, threads = plan.opts.device, plan.opts.threads or 1
    if device == "cuda" and not gpus:
        raise UserError("--device cuda: the Ray cluster has no GPU")
    if gpus and device in ("auto", "cuda"):
        ask, fit, what = {"num_gpus": 1, "num_cpus": 1}, min(gpus, cpus), f"{gpus} GPUs, one per worker"
    else:
        ask, fit, what = {"num_cpus": threads}, cpus // threads, f"{cpus} CPUs, {threads} thread(s) per worker (-t)"
    n = workers or max(1, fit)
    if n > fit:
        asked = f"--ray-workers {n}" if workers else f"-t {threads}"
        raise UserError(f"{asked}: the Ray cluster has room for {fit} worker(s) ({what})")
    return n, ask, threads


def first_line(error: BaseException) -> str:
    """An exception's first line, cut to 160 characters (Ray's messages run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


@contextlib.contextmanager
def no_stderr():
    """File descriptor 2 goes to /dev/null for the block (what Ray's C++ code writes never reaches Python's
    sys.stderr), and comes back after it."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class quiet:
    """Ray's own log lines (starting, connecting, killing) stay off the user's terminal."""

    def __enter__(self):
        self.logger = logging.getLogger("ray")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
        return False
