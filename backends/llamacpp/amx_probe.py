"""Whether llama.cpp's AMX weight layout runs on this machine: tried once in a child process, then cached.

A llama.cpp built on an Intel CPU whose flags list ``amx_int8`` (``-march=native``) moves Q4_0/Q4_1/Q8_0 and
K-quant weights into an "AMX" buffer whose matrix products use tile instructions. On some virtual machines
those instructions fault: SIGILL in ``ggml_backend_amx_mul_mat`` at the first prefill, although the CPU flags and
the kernel's AMX permission call both say yes (seen on a Firecracker guest on a Xeon with AMX; the class of
ggml-org/llama.cpp reports of ISA features a hypervisor lists but does not run). The fault kills the process,
so the check runs in a child: load the model with llama.cpp's extra buffer types, prefill 64 tokens, decode one.
A child killed by a signal means zoomr loads models with ``use_extra_bufts = false`` on this machine (llama.cpp's
``--no-extra-bufts``: plain CPU layouts, which also gives up llama.cpp's repacked Q4_0/K-quant layouts).

Only builds whose ``llama_print_system_info`` says ``AMX_INT8 = 1`` are probed; the answer is cached per CPU
model, llama-cpp-python version and build features in ``amx_probe.json`` (:mod:`zoomr.backends.machine_cache`).
A child that exits normally without using the AMX buffer (a model with no AMX-able weights) proves nothing and
is not cached.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zoomr.backends.machine_cache import cpu_name, lookup, store

CACHE_FILE = "amx_probe.json"
PROBE_TOKENS = 64       # a prefill this long takes ggml's tile path (one-row products take a VNNI path)
PROBE_TIMEOUT_S = 600   # loading a large model in the child can take minutes on a slow disk
_USED = "AMX buffer used"
# verdicts this process found, by cache key: the answer stands even where the cache cannot be written
_found: dict[str, bool] = {}


def _system_info() -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()


def built_with_amx() -> bool:
    """True when this llama.cpp build compiled its AMX kernels (``AMX_INT8 = 1`` in its system info)."""
    return "AMX_INT8 = 1" in _system_info()


def _key() -> str:
    import llama_cpp

    return f"{cpu_name()}|llama_cpp {llama_cpp.__version__}|{_system_info()}"


def known_verdict() -> bool | None:
    """The verdict for this machine and build (True: AMX layouts run) that this process found or the cache
    holds, or None when never probed or when the build has no AMX kernels. Never starts a child."""
    if not built_with_amx():
        return None
    if _key() in _found:
        return _found[_key()]
    hit = lookup(CACHE_FILE, _key())
    return hit.get("extra_bufts") if hit is not None and isinstance(hit.get("extra_bufts"), bool) else None


def extra_bufts_ok(path: Path) -> bool:
    """Whether models may load with llama.cpp's extra CPU buffer types (AMX, repacked layouts) here.

    True without a child process when the build has no AMX kernels. Otherwise the cached verdict, else a child
    (``python -m zoomr.backends.llamacpp.amx_probe MODEL``) loads ``path`` and runs it: a child killed by a signal
    gives False (cached); a clean exit that used the AMX buffer gives True (cached); anything else (the model
    does not load, no AMX-able weights, a timeout) gives True uncached, so the real load reports its own error.

    Args:
        path: the GGUF file about to be loaded (its weight types decide whether AMX is used at all).
    """
    if not built_with_amx():
        return True
    known = known_verdict()
    if known is not None:
        return known
    try:
        child = subprocess.run([sys.executable, "-m", __name__, str(path)], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if child.returncode < 0:
        _found[_key()] = False
        store(CACHE_FILE, _key(), {"extra_bufts": False, "signal": -child.returncode})
        return False
    if child.returncode == 0 and _USED in child.stdout:
        _found[_key()] = True
        store(CACHE_FILE, _key(), {"extra_bufts": True})
    return True


def _child(path: str) -> int:
    """Load ``path`` with extra buffer types, prefill PROBE_TOKENS tokens and decode one; 0 when both ran."""
    import ctypes

    import llama_cpp

    used = []

    @llama_cpp.llama_log_callback
    def _log(level, text, user_data):
        if b"AMX" in text and b"buffer size" in text:
            used.append(True)

    llama_cpp.llama_log_set(_log, None)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        return 3
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 2 * PROBE_TOKENS
    cparams.n_threads = cparams.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        return 4
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    for start, count in ((0, PROBE_TOKENS), (PROBE_TOKENS, 1)):
        ids = (ctypes.c_int32 * count)(*[(start + i) % n_vocab for i in range(count)])
        batch = llama_cpp.llama_batch_get_one(ids, count)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            return 5
    print(_USED if used else "AMX buffer not used", flush=True)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
