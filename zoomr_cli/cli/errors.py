"""One-line errors on stderr with meaningful exit codes; tracebacks only with ZOOMR_DEBUG=1."""

from __future__ import annotations

import os
import sys
import traceback

from zoomr.errors import UserError  # noqa: F401  (re-exported: commands raise it)

EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130




def debug_enabled() -> bool:
    """True when ZOOMR_DEBUG asks for full tracebacks."""
    return os.environ.get("ZOOMR_DEBUG", "") not in ("", "0")


def fail(exc: BaseException, code: int) -> int:
    """Print ``exc`` as one ``zoomr: error: ...`` line (or a traceback in debug mode); return ``code``."""
    if debug_enabled():
        traceback.print_exception(exc)
    msg = " ".join(str(exc).split()) or type(exc).__name__
    print(f"zoomr: error: {msg}", file=sys.stderr)
    return code
