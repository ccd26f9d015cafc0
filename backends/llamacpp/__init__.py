"""llama.cpp backend: llama-cpp-python's low-level API with KV sequence ops (eviction, fork).

``engine.LlamaCppBackend`` is the :class:`zoomr.backends.base.Backend`. The KV policies llama.cpp can run
(full, streaming, sumr) are in ``policies`` and ``sumr``; ``sequence`` holds a sequence's bookkeeping
and the evict-and-shift operation; ``batch`` and ``runtime`` wrap the raw C API.
"""
