"""``--policy`` names → policies, and the cache factory the torch backend plugs in.

Defaults (paper first, reference code second):
    streaming  sink 4, window B − sink                         (StreamingLLM)
    h2o        recent window B/2, heavy hitters B/2            (H2O's 50/50 split)
    snapkv     observation window min(32, B/2), pool 5, buffer 128 (SnapKV; buffer as R-KV)
    rkv        window 8, λ 0.1, pool 7, buffer 128             (R-KV paper; code λ 0.07)
    sumr/zoomr window 128, k 2, c 2, summaries auto            (ZoomR; the paper's analysis uses a
               512-token window at 16K tokens, 128 suits the short generations of small models)
``--budget`` applies to streaming, h2o, snapkv and rkv; SumR and ZoomR are not budgeted (their active
size follows from the segments; the paper gives the baselines ZoomR's measured budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache import OFFLOAD_MODES, PolicyKVCache
from .events import EventBus
from .full import FullPolicy
from .h2o import H2OPolicy
from .policy import KVPolicy
from .rkv import RKVPolicy
from .segments import SUMMARY_MODES
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy
from .sumr import SumRPolicy
from .zoomr import ZoomRPolicy

POLICY_NAMES = ("full", "streaming", "h2o", "snapkv", "rkv", "sumr", "zoomr")
SEGMENTED = ("sumr", "zoomr")
BUDGETED = ("streaming", "h2o", "snapkv", "rkv")
# which policies read each knob of PolicySpec (the others ignore it); the bench says so instead of silently
# applying a knob to a policy that has no such thing
KNOB_POLICIES = {
    "budget": BUDGETED,
    "window": ("streaming", "h2o", "snapkv", "rkv", "sumr", "zoomr"),
    "sink": ("streaming",),
    "topk_per_head": ("zoomr",),
    "consensus": ("zoomr",),
    "summaries": SEGMENTED,
}


@dataclass(frozen=True)
class PolicySpec:
    """The ``--policy`` family of options (units: tokens).

    Attributes:
        name: one of :data:`POLICY_NAMES`.
        budget: B (``--budget``), for streaming, h2o, snapkv, rkv.
        window: ``--window``; None = the policy's default (see the module docstring).
        topk_per_head, consensus: ZoomR's k and c.
        sink: StreamingLLM's sink tokens.
        summaries: ``model``, ``prompted`` or ``auto`` (SumR, ZoomR).
        offload: ``resident`` or ``stream`` (see :class:`zoomr.kvstore.cache.PolicyKVCache`).
    """

    name: str = "full"
    budget: int = 64
    window: int | None = None
    topk_per_head: int = 2
    consensus: int = 2
    sink: int = 4
    summaries: str = "auto"
    offload: str = "resident"

    def build(self) -> KVPolicy:
        """A fresh policy for one cache.

        Raises:
            ValueError: unknown name, summaries mode or offload mode, or knobs out of range (one message).
        """
        if self.name not in POLICY_NAMES:
            raise ValueError(f"--policy {self.name!r} unknown (choose from {', '.join(POLICY_NAMES)})")
        if self.summaries not in SUMMARY_MODES:
            raise ValueError(f"--summaries {self.summaries!r} unknown (choose from {', '.join(SUMMARY_MODES)})")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload {self.offload!r} unknown (choose from {', '.join(OFFLOAD_MODES)})")
        if self.budget < 1:
            raise ValueError(f"--budget must be at least 1 token, got {self.budget}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"--window must be at least 1 token, got {self.window}")
        w = self.window
        if self.name == "full":
            return FullPolicy()
        if self.name == "streaming":
            return StreamingPolicy(self.budget, self.sink, w)
        if self.name == "h2o":
            return H2OPolicy(self.budget, w)
        if self.name == "snapkv":
            return SnapKVPolicy(self.budget, w)
        if self.name == "rkv":
            return RKVPolicy(self.budget, w)
        if self.name == "sumr":
            return SumRPolicy(128 if w is None else w, self.summaries)
        return ZoomRPolicy(128 if w is None else w, self.topk_per_head, self.consensus, self.summaries)


class PolicyCacheFactory:
    """``cache_factory`` for :class:`zoomr.backends.torch.engine.TorchBackend`: one :class:`PolicyKVCache` per sequence.

    Args:
        spec: the policy options; validated here, before any model is loaded.
    Raises:
        ValueError: see :meth:`PolicySpec.build`.

    Attributes:
        policy_name: the policy with its knobs, e.g. ``zoomr(k=2, c=2, window=128, summaries=auto)``.
        events: :class:`zoomr.kvstore.events.EventBus` every cache made here publishes to.
    """

    def __init__(self, spec: PolicySpec):
        self.spec = spec
        self.policy_name = spec.build().describe() + (" · offloaded" if spec.offload == "stream" else "")
        self.events = EventBus()

    def __call__(self, backend) -> PolicyKVCache:
        cfg = backend.cfg
        return PolicyKVCache(self.spec.build(), cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             backend.device, backend.dtype, self.spec.offload, self.events)
