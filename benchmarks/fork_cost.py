"""Cost of forking a KV cache (what KV-Rescue does N_b + N_h times per step), by policy and context length.

Not a test: times depend on the machine and its load. Random K/V at the embedded model's shape
(SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head_dim 64), fp32, CPU. Each cache is filled
with a 64-token prompt and then forwards of 32 tokens whose text closes a paragraph (so SumR/ZoomR
hold one segment per 32 tokens and select), up to ``positions``. Then, per row:

* ``fork_ms``: median wall time of one ``cache.fork()`` (``--repeat`` forks, each freed after; one
  untimed fork before them settles the parent's pending selection, work its next forward would do);
* ``child_step_ms`` / ``parent_step_ms``: one single-token forward of a fresh fork, then of its parent
  (after the fork wrote its token): any copying a copy-on-write fork put off lands in one of these;
* ``fork_new_mib``: tensor storage that ``--keep`` forks, each after one step, hold and their parent
  does not, per fork (MiB; distinct storages reachable from the caches' attributes): what a fork
  did not share, the copies a copy-on-write side made at its first step included.

Rows: ``full`` (the torch backend's plain on-device cache, ``FullKVCache``), ``full-offloaded``
(``PolicyKVCache`` with the full policy, streamed), and ``PolicyKVCache`` with ``rkv`` (B=64), ``h2o``
(B=64), ``sumr`` and ``zoomr`` (defaults), resident.

    python benchmarks/fork_cost.py [--positions 64 512 2048 8192] [--repeat 5] [--keep 2] [--json out.json|-]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from zoomr.kvstore.base import FullKVCache
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.h2o import H2OPolicy
from zoomr.kvstore.full import FullPolicy
from zoomr.kvstore.rkv import RKVPolicy
from zoomr.kvstore.sumr import SumRPolicy
from zoomr.kvstore.zoomr import ZoomRPolicy

L, H, HKV, D = 30, 9, 3, 64
CPU = torch.device("cpu")
PROMPT, CHUNK = 64, 32


def make(name: str):
    """A fresh cache of policy ``name`` at the embedded model's shape."""
    if name == "full":
        return FullKVCache(L, HKV, D, CPU, torch.float32)
    policy, offload = {"full-offloaded": (FullPolicy, "stream"), "rkv": (lambda: RKVPolicy(64), "resident"),
                       "h2o": (lambda: H2OPolicy(64), "resident"), "sumr": (SumRPolicy, "resident"),
                       "zoomr": (ZoomRPolicy, "resident")}[name]
    return PolicyKVCache(policy(), L, H, HKV, D, CPU, torch.float32, offload)


def forward(cache, T: int, text: str, g: torch.Generator) -> None:
    """One forward of T random tokens through every layer."""
    for layer in range(L):
        cache.update(layer, torch.randn(H, T, D, generator=g), torch.randn(HKV, T, D, generator=g),
                     torch.randn(HKV, T, D, generator=g))
    cache.end_forward([0] * T, text)


def filled(name: str, positions: int, seed: int = 0):
    """A cache of ``name`` holding ``positions`` positions (prompt, then paragraph-closing forwards)."""
    g = torch.Generator().manual_seed(seed)
    cache = make(name)
    first = min(PROMPT, positions)
    forward(cache, first, "prompt", g)
    n = first
    while n < positions:
        T = min(CHUNK, positions - n)
        forward(cache, T, " w" * (T - 1) + ".\n\n", g)
        n += T
    return cache, g


def storage_bytes(objs) -> int:
    """Bytes of the distinct tensor storages reachable from ``objs`` through attributes and containers."""
    seen, storages, stack = set(), {}, list(objs)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (int, float, str, bytes, type(None), torch.dtype, torch.device)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not callable(o):
            stack.extend(vars(o).values())
        elif hasattr(o, "__slots__"):
            stack.extend(getattr(o, a) for a in o.__slots__ if hasattr(o, a))
    return sum(storages.values())


def measure(name: str, positions: int, repeat: int, keep: int) -> dict:
    cache, g = filled(name, positions)
    # untimed: a fork first applies the parent's pending selection, which its next forward would anyway
    cache.fork()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        child = cache.fork()
        times.append(time.perf_counter() - t0)
        del child
    child = cache.fork()
    t0 = time.perf_counter()
    forward(child, 1, " w", g)
    child_step = time.perf_counter() - t0
    t0 = time.perf_counter()
    forward(cache, 1, " w", g)
    parent_step = time.perf_counter() - t0
    del child
    gc.collect()
    before = storage_bytes([cache])
    kids = []
    for _ in range(keep):
        kids.append(cache.fork())
        forward(kids[-1], 1, " w", g)
    grown = storage_bytes([cache, *kids]) - before
    del kids
    gc.collect()
    return {"policy": name, "positions": positions, "fork_ms": round(statistics.median(times) * 1e3, 3),
            "child_step_ms": round(child_step * 1e3, 2), "parent_step_ms": round(parent_step * 1e3, 2),
            "fork_new_mib": round(grown / keep / 2 ** 20, 2), "kv_mib": round(positions * L * 2 * HKV * D * 4 / 2 ** 20, 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[64, 512, 2048, 8192])
    ap.add_argument("--policies", nargs="+", default=["full", "full-offloaded", "rkv", "h2o", "sumr", "zoomr"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--json", help="write the rows as JSON to this path ('-': stdout)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.policies:
        for n in args.positions:
            rows.append(measure(name, n, args.repeat, args.keep))
            r = rows[-1]
            print(f"{name:15s} {n:6d}  fork {r['fork_ms']:9.3f} ms  child step {r['child_step_ms']:8.2f} ms  "
                  f"parent step {r['parent_step_ms']:8.2f} ms  +{r['fork_new_mib']:7.2f} MiB/fork "
                  f"(KV {r['kv_mib']} MiB)", file=sys.stderr)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=1)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
