"""``full``: no eviction, every position stays attended — the reference every fidelity number uses."""

from __future__ import annotations

from dataclasses import dataclass

from .knobs import PolicyConfig
from .policy import KVPolicy


class FullPolicy(KVPolicy):
    """Keeps every position (through the host store; on CUDA the offloaded-full baseline when streamed)."""

    name = "full"
    evicts = False

    def fork(self, ctx):
        """No state: a fork costs one object."""
        return self._fork_shallow(ctx)


@dataclass(frozen=True)
class FullConfig(PolicyConfig):
    """``full`` has no knob."""

    def build(self) -> FullPolicy:
        return FullPolicy()
