"""What one run of a model needs: model, backend, context, sampling and KV policy (llama.cpp names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zoomr.backends.sampling import SamplingParams

POLICIES = ("full", "streaming", "h2o", "snapkv", "rkv", "sumr", "zoomr")


@dataclass
class RunOptions:
    """Model, backend and sampling settings of one command invocation (units: tokens, threads)."""

    model: Optional[str] = None
    backend: str = "torch"
    ctx_size: int = 4096
    n_predict: int = 512
    threads: Optional[int] = None
    n_gpu_layers: int = -1
    device: str = "auto"
    dtype: str = "auto"
    temp: Optional[float] = None
    # KV-Rescue's (arXiv:2608.15797) top-k for every command: solve and bench run --rescue with it, and
    # bench records it; greedy runs (--temp 0) do not read it. llama.cpp's own default is 40.
    top_k: int = 20
    top_p: float = 0.95
    seed: int = 0
    ignore_eos: bool = False
    policy: str = "full"
    budget: int = 64
    window: Optional[int] = None
    topk_per_head: int = 2
    consensus: int = 2
    sink: int = 4
    summaries: str = "auto"

    def sampling(self, default_temp: float) -> SamplingParams:
        """Validated sampling params; ``default_temp`` applies when ``--temp`` was not given.

        Raises:
            ValueError: an invalid sampling value.
        """
        temp = default_temp if self.temp is None else self.temp
        return SamplingParams(temperature=temp, top_k=self.top_k, top_p=self.top_p, seed=self.seed).validate()
