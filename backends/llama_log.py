"""Silencing llama.cpp's C-level logging, so users see only zoomr's own output."""

from __future__ import annotations

_callback = None  # keeps the ctypes callback alive for the process lifetime


def silence_llama_logs() -> None:
    """Route llama.cpp and ggml log lines to a no-op (idempotent). ZOOMR_DEBUG=1 keeps them."""
    global _callback
    import os

    if _callback is not None or os.environ.get("ZOOMR_DEBUG", "") not in ("", "0"):
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    def _drop(level, text, user_data):
        return None

    _callback = _drop
    llama_cpp.llama_log_set(_callback, None)
