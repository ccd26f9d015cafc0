"""Terminal output: live token streaming (rich) or plain text for pipes, and the statistics line."""

from __future__ import annotations

import sys

from rich.console import Console

from zoomr.backends.base import KVStats
from zoomr.backends.generation import GenerationStats


def mib(n_bytes: int) -> str:
    """Bytes as a short MiB/KiB string."""
    return f"{n_bytes / 2**20:.2f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 1024:.1f} KiB"


def count(n: int, noun: str) -> str:
    """``1 problem``, ``3 problems``: ``n`` and ``noun`` in the number ``n`` asks for (nouns taking -s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def stats_line(gen: GenerationStats, kv: KVStats) -> str:
    """One line: prefill and decode throughput, KV tokens and bytes (active / full)."""
    return (f"prefill {gen.prompt_tokens} tok @ {gen.prefill_tok_s:.1f} tok/s · "
            f"decode {gen.generated_tokens} tok @ {gen.decode_tok_s:.1f} tok/s · "
            f"KV {kv.active_tokens}/{kv.full_tokens} tok active/full "
            f"({mib(kv.active_bytes)} / {mib(kv.full_bytes)}, mean {kv.mean_active_tokens:.0f}, "
            f"peak {kv.peak_active_tokens} tok) · "
            f"stop: {gen.stop_reason or '—'}")


class Output:
    """Where a command writes: stdout for the model's text and results, stderr for progress.

    Args:
        live: stream with rich styling; False writes plain text only (for pipes and CI).
        stdout_free: send the model's text and results to stderr as well, leaving stdout to one
            machine-readable record (``--json -``), as ``curl -o -`` keeps its progress off stdout.
    """

    def __init__(self, live: bool, stdout_free: bool = False):
        self.live = live
        self._text = sys.stderr if stdout_free else sys.stdout
        self.out = Console(stderr=stdout_free, highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)

    def token(self, delta: str) -> None:
        """Write streamed model text as it arrives."""
        if self.live:
            self.out.print(delta, end="", markup=False)
        else:
            self._text.write(delta)
            self._text.flush()

    def info(self, text: str) -> None:
        """A progress/status line on stderr."""
        if self.live:
            self.err.print(f"[dim]{text}[/dim]")
        else:
            print(text, file=sys.stderr)

    def result(self, label: str, value: str, style: str = "bold green") -> None:
        """A ``label: value`` result line on stdout (stderr when ``stdout_free``)."""
        if self.live:
            self.out.print(f"[{style}]{label}:[/{style}] ", end="")
            self.out.print(value, markup=False)
        else:
            print(f"{label}: {value}", file=self._text)

    def status(self, text: str):
        """A spinner context on stderr while something slow runs (no-op when not live)."""
        if self.live:
            return self.err.status(text)
        print(text, file=sys.stderr)
        return _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
