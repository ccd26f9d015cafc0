"""zoomr: long reasoning under a fixed KV-cache budget, from Python and from the command line.

The public API (README "Using zoomr from Python", ``examples/library.py``)::

    import zoomr
    model = zoomr.load(policy="h2o", budget=32)                 # the embedded model, H2O with B = 32 tokens
    result = zoomr.solve(model, "What is 17 * 23?", on_token=lambda t: print(t, end="", flush=True))
    result.answer, result.kv.mean_active_tokens                 # the \\boxed{} answer, KV tokens attended

Names are imported on first use (PEP 562), so ``import zoomr.kvstore`` or ``zoomr --version`` loads
neither torch nor the backends until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name → the module that defines it (layers, low → high: README "How it is built")
_EXPORTS = {
    "UserError": "zoomr.errors",
    "grade": "zoomr.grading",
    "extract_answer": "zoomr.grading",
    "KVStats": "zoomr.kvstore.stats",
    "PolicyKVCache": "zoomr.kvstore.cache",
    "SamplingParams": "zoomr.backends.sampling",
    "RunOptions": "zoomr.options",
    "POLICIES": "zoomr.kvstore.registry",
    "load": "zoomr.loading",
    "make_policy": "zoomr.loading",
    "solve_prompt": "zoomr.prompts",
    "solve": "zoomr.solving",
    "SolveResult": "zoomr.solving",
    "run_rescue": "zoomr.rescue.runner",
    "RescueConfig": "zoomr.rescue.loop",
    "DetectorConfig": "zoomr.rescue.degeneration",
    "load_problems": "zoomr.evaluation.datasets",
    "bench": "zoomr.evaluation.runner",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zoomr' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
