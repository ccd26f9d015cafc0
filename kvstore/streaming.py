"""``streaming``: StreamingLLM — attention-sink tokens plus the most recent tokens.

Source: Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks" (github
mit-han-lab/streaming-llm): keep the first ``sink`` positions (4) and the most recent ones.
The original stores keys before RoPE and re-rotates them to their position inside the cache; here
keys keep their original positions (the common simplification), so no re-rotation happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .knobs import PolicyConfig, budget_knob, knob, window_knob
from .policy import ForwardInfo, KVPolicy


@dataclass(frozen=True)
class StreamingConfig(PolicyConfig):
    """StreamingLLM's knobs (tokens); ``sink + window ≤ budget``."""

    budget: int = budget_knob()
    sink: int = knob(4, "attention-sink tokens kept at the start", minimum=0, tokens=True,
                     source="StreamingLLM")
    window: int | None = window_knob(None, "B − sink (StreamingLLM)")

    def build(self) -> "StreamingPolicy":
        return StreamingPolicy(self.budget, self.sink, self.window)


class StreamingPolicy(KVPolicy):
    """Sink + recent window, recomputed after every forward.

    Args:
        budget: B, positions kept (tokens).
        sink: first positions always kept (tokens; paper: 4).
        window: recent positions kept (tokens); default B − sink.
    Raises:
        ValueError: budget < 1, sink < 0, window < 1, or budget < sink + window.
    """

    name = "streaming"

    def __init__(self, budget: int, sink: int = 4, window: int | None = None):
        window = streaming_window(budget, sink, window)
        self.budget, self.sink, self.window = budget, sink, window
        self.slack = 1   # the token being decoded is attended before the next eviction

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """Keep [0, sink) ∪ [n − window, n) once more than that has been written."""
        n = fwd.end
        if n <= self.sink + self.window:
            return None
        keep = torch.cat([torch.arange(self.sink), torch.arange(n - self.window, n)])
        return keep.expand(self.ctx.n_kv_heads, -1)

    def fork(self, ctx):
        """No state beyond the knobs: a fork costs one object."""
        return self._fork_shallow(ctx)

    def describe(self) -> str:
        return f"streaming(B={self.budget}, sink={self.sink}, window={self.window})"


def streaming_window(budget: int, sink: int, window: int | None) -> int:
    """The recent window of StreamingLLM under ``budget`` (tokens): ``budget − sink`` unless given.

    Raises:
        ValueError: budget < 1, sink < 0, no room for a window, or sink + window > budget.
    """
    if budget < 1:
        raise ValueError(f"--budget must be at least 1 token, got {budget}")
    if sink < 0:
        raise ValueError(f"--sink must be >= 0, got {sink}")
    window = budget - sink if window is None else window
    if window < 1:
        raise ValueError(f"streaming: --budget {budget} leaves no recent window after --sink {sink}")
    if sink + window > budget:
        raise ValueError(f"streaming: --budget {budget} is smaller than --sink {sink} + --window {window}")
    return window
