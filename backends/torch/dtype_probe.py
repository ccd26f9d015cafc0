"""``--dtype auto`` on a CPU: bf16 or fp16, whichever this machine runs the model's GEMVs faster, measured once.

Which half-precision type a CPU runs faster depends on its instructions (AVX512-BF16/AMX run bf16 natively;
AVX2 machines convert both, at different costs) and on the kernel: torch's int4/int8 weight-only kernels have
a vectorized bf16 path and much slower fp16 ones, while dense fp16 GEMVs beat dense bf16 on some AVX2 CPUs
(measured 1.65× in decode on a 2-core AVX2 machine). So the choice is measured, with the kernel the model will
run, on a working set larger than the last-level cache (decode streams every weight once per token), and
cached per machine in ``$ZOOMR_CACHE`` (default ``$XDG_CACHE_HOME/zoomr``, else ``~/.cache/zoomr``),
``dtype_probe.json``, keyed by CPU model, torch version and build capability, threads and kernel.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from zoomr.backends.machine_cache import cpu_name, lookup, store

CANDIDATES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# 48 MiB of bf16 dense weights (or a quarter of that in int4 codes, ×4 matrices): past a 32 MiB L3
_ROWS, _COLS, _DENSE_MATS, _INT4_MATS = 2048, 2048, 6, 24


def _key(kernel: str) -> str:
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    return f"{cpu_name()}|torch {torch.__version__}|{cap}|threads {torch.get_num_threads()}|{kernel}"


def _time_ms(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(kernel: str) -> dict[str, float]:
    """Milliseconds per pass of one-row GEMVs over a beyond-cache working set, per candidate dtype.

    Args:
        kernel: ``dense`` (``F.linear``), ``int4`` (``_weight_int4pack_mm_for_cpu``, groups of 32) or ``int8``
            (``_weight_int8pack_mm``).
    Returns:
        {"bf16": ms, "fp16": ms}; a dtype whose kernel fails gets ``inf``.
    """
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dt in CANDIDATES.items():
        x = torch.randn(1, _COLS, generator=g).to(dt)
        try:
            if kernel == "int4":
                codes = torch.randint(0, 16, (_ROWS, _COLS), dtype=torch.int32, generator=g)
                packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1) for _ in range(_INT4_MATS)]
                sz = (torch.rand(_COLS // 32, _ROWS, 2, generator=g) * 0.01).to(dt)

                def run():
                    for p in packed:
                        torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)
            elif kernel == "int8":
                w8 = [torch.randint(-127, 128, (_ROWS, _COLS), dtype=torch.int8, generator=g)
                      for _ in range(_INT4_MATS // 2)]
                scale = (torch.rand(_ROWS, generator=g) * 0.01).to(dt)

                def run():
                    for w in w8:
                        torch.ops.aten._weight_int8pack_mm(x, w, scale)
            else:
                ws = [(torch.randn(_ROWS, _COLS, generator=g) * 0.02).to(dt) for _ in range(_DENSE_MATS)]

                def run():
                    for w in ws:
                        F.linear(x, w)
            out[name] = _time_ms(run)
        except RuntimeError:
            out[name] = float("inf")
    return out


def cpu_half_dtype(kernel: str) -> torch.dtype:
    """The faster of bf16 and fp16 for ``kernel`` (``dense``, ``int4``, ``int8``) on this CPU: cached, else measured
    (about a second) and cached. An unwritable cache only means measuring again next time."""
    key = _key(kernel)
    hit = lookup("dtype_probe.json", key)
    if hit is not None and hit.get("dtype") in CANDIDATES:
        return CANDIDATES[hit["dtype"]]
    ms = measure(kernel)
    best = min(ms, key=ms.get)
    store("dtype_probe.json", key,
          {"dtype": best, "ms": {k: (round(v, 3) if v != float("inf") else None) for k, v in ms.items()}})
    return CANDIDATES[best]
