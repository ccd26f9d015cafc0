"""The one table of KV policies: ``--policy`` name → config, class and capabilities.

Everything that lists or checks policies reads :data:`REGISTRY`: the CLI's ``--policy`` choices and knob
flags, bench's cells and knob checks, KV-Rescue's base-policy choices, the llama.cpp backend's support
check and docs/policies.md's policy table (:func:`policy_table_markdown`). Adding a policy is one new file (its
:class:`~zoomr.kvstore.knobs.PolicyConfig` with its own knobs, and its
:class:`~zoomr.kvstore.policy.KVPolicy`) plus one entry in the table below.

Defaults and their sources sit with each config's knobs (the policy files); docs/policies.md's table shows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cache import OFFLOAD_MODES, PolicyKVCache
from .events import EventBus
from .full import FullConfig, FullPolicy
from .h2o import H2OConfig, H2OPolicy
from .keydiff import KeyDiffConfig, KeyDiffPolicy
from .knobs import Knob, KnobInfo, PolicyConfig, flag, knobs_of
from .policy import KVPolicy
from .rkv import RKVConfig, RKVPolicy
from .snapkv import SnapKVConfig, SnapKVPolicy
from .streaming import StreamingConfig, StreamingPolicy
from .sumr import SumRConfig, SumRPolicy
from .triattention import TriAttentionConfig, TriAttentionPolicy
from .zoomr import ZoomRConfig, ZoomRPolicy

BACKENDS = ("torch", "llamacpp")
BOTH = BACKENDS
REFERENCE = "full"  # evicts nothing: the yardstick of fidelity, and the full-KV helper of KV-Rescue


@dataclass(frozen=True)
class PolicyInfo:
    """One row of the registry.

    Attributes:
        name: the ``--policy`` name (the policy class's ``name``).
        config: the policy's config dataclass; its fields are the policy's knobs.
        policy: the policy class (:meth:`PolicyConfig.build` makes one).
        summary: what the policy keeps, one line (docs/policies.md, ``--help``).
        scores: the attention signal it ranks positions by, e.g. "accumulated attention scores"; empty
            when it needs only the tokens and their text.
        backends: the backends that implement it (of :data:`BACKENDS`).
        label: its name in prose, as its paper spells it ("R-KV", "ZoomR"); empty: :attr:`name`.
        colour: its hex colour in every plot ("#d55e00"); empty: a stable colour picked from the name
            (:func:`zoomr.evaluation.plots.policy_colour`).
        matched_target: its measured mean active KV sets the budgets of ``bench --match-budget``'s
            baselines (one policy at most: :func:`matched_target`).
        rescue_base_for: the backends on which it is KV-Rescue's base policy when ``--base-policy`` is
            not given (one per backend: :func:`rescue_base`).
    """

    name: str
    config: type[PolicyConfig]
    policy: type[KVPolicy]
    summary: str
    scores: str = ""
    backends: tuple[str, ...] = ("torch",)
    label: str = ""
    colour: str = ""
    matched_target: bool = False
    rescue_base_for: tuple[str, ...] = ()

    @property
    def knobs(self) -> tuple[Knob, ...]:
        """The config's knobs, in declaration order."""
        return knobs_of(self.config)

    @property
    def knob_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    @property
    def host_store(self) -> bool:
        """Positions it evicted can come back, so every K/V stays in the host store (the policy class's
        ``restores_evicted``)."""
        return self.policy.restores_evicted

    @property
    def budgeted(self) -> bool:
        """Evicts down to ``--budget`` (the others size themselves: full keeps all, SumR/ZoomR follow segments)."""
        return "budget" in self.knob_names

    @property
    def needs_scores(self) -> bool:
        return bool(self.scores)

    @property
    def evicts(self) -> bool:
        """Leaves positions out of the attended set (the policy class's ``evicts``; full does not)."""
        return self.policy.evicts

    @property
    def display(self) -> str:
        """The name prose uses: :attr:`label`, else :attr:`name`."""
        return self.label or self.name


REGISTRY: dict[str, PolicyInfo] = {}


@dataclass(frozen=True)
class KnobFlag:
    """One command-line flag of the policy knobs: every policy with a knob of this name reads it.

    Attributes:
        name: the knob's name (``topk_per_head``); flag: ``--topk-per-head``.
        type: the value type; info: meaning and range (the first policy's, in table order; all agree on
            the range, see :func:`register`).
        default: the readers' common default, or None when they differ (each then uses its own).
        readers: the policies that have this knob.
    """

    name: str
    type: type
    info: KnobInfo
    default: Any
    readers: tuple[str, ...]

    @property
    def flag(self) -> str:
        return flag(self.name)

    def check(self, value: Any) -> None:
        """Raise ``ValueError`` naming the flag when ``value`` is outside the knob's range."""
        self.info.check(self.flag, value)


def knob_flags() -> dict[str, KnobFlag]:
    """Every knob of every registered policy, by name, in table order (first appearance)."""
    seen: dict[str, list[tuple[str, Knob]]] = {}
    for name, info in REGISTRY.items():
        for k in info.knobs:
            seen.setdefault(k.name, []).append((name, k))
    out = {}
    for knob_name, rows in seen.items():
        first = rows[0][1]
        defaults = {repr(k.default) for _, k in rows}
        out[knob_name] = KnobFlag(knob_name, first.type, first.info, first.default if len(defaults) == 1 else None,
                                  tuple(n for n, _ in rows))
    return out


def register(info: PolicyInfo) -> PolicyInfo:
    """Add a policy to :data:`REGISTRY`.

    Raises:
        ValueError: a name taken or not the class's, an unknown backend, or a knob that another policy
            has with another type or range (they share one flag).
        TypeError: a config field not declared with :func:`zoomr.kvstore.knobs.knob`.
    """
    if info.name in REGISTRY:
        raise ValueError(f"policy {info.name!r} is registered already")
    if info.policy.name != info.name:
        raise ValueError(f"policy {info.name!r}: its class is named {info.policy.name!r}")
    if not info.backends or set(info.backends) - set(BACKENDS):
        raise ValueError(f"policy {info.name!r}: backends must be among {', '.join(BACKENDS)}, got {info.backends}")
    _check_roles(info)
    shared = knob_flags()
    for k in info.knobs:
        other = shared.get(k.name)
        if other is not None and (other.type, _range(other.info)) != (k.type, _range(k.info)):
            raise ValueError(f"policy {info.name!r}: {k.flag} must have the type and range it has for "
                             f"{', '.join(other.readers)} (one flag serves them all)")
    REGISTRY[info.name] = info
    return info


def _range(info: KnobInfo) -> tuple:
    return info.minimum, info.choices, info.tokens


def _check_roles(info: PolicyInfo) -> None:
    """A role one policy plays (matched target, a backend's default rescue base) is not claimed twice, and a
    rescue base evicts on a backend that runs it.

    Raises:
        ValueError: naming the role and the policy that holds it.
    """
    roles = [("the matched-budget target", lambda i: i.matched_target)] if info.matched_target else []
    for backend in info.rescue_base_for:
        if backend not in info.backends or not info.evicts:
            raise ValueError(f"policy {info.name!r}: a default rescue base on {backend} must evict and run there")
        roles.append((f"the default rescue base on {backend}", lambda i, b=backend: b in i.rescue_base_for))
    for role, holds in roles:
        taken = [n for n, i in REGISTRY.items() if holds(i)]
        if taken:
            raise ValueError(f"policy {info.name!r}: {taken[0]} is {role} already")


# colours: Okabe–Ito hues (colour-blind safe); full is the black reference, ZoomR the strongest hue
for _row in (
    PolicyInfo("full", FullConfig, FullPolicy, "everything: no eviction (the reference)",
               backends=("torch", "llamacpp"), label="full KV", colour="#000000"),
    PolicyInfo("streaming", StreamingConfig, StreamingPolicy, "attention sinks + the most recent tokens (StreamingLLM)",
               backends=("torch", "llamacpp"), label="StreamingLLM", colour="#8c8c8c",
               rescue_base_for=("llamacpp",)),   # the one evicting policy llama.cpp runs without segments
    PolicyInfo("h2o", H2OConfig, H2OPolicy, "heavy hitters by accumulated attention + recent tokens (H2O)",
               scores="accumulated attention scores", label="H2O", backends=BOTH, colour="#56b4e9"),
    PolicyInfo("snapkv", SnapKVConfig, SnapKVPolicy, "per KV head top keys by pooled observation-window attention "
               "+ the window (SnapKV)", scores="attention of an observation window", label="SnapKV",
               backends=BOTH, colour="#009e73"),
    PolicyInfo("rkv", RKVConfig, RKVPolicy, "per KV head top keys by attention mixed with key redundancy, "
               "compressed every 128 tokens (R-KV)", scores="attention scores and key similarity", label="R-KV",
               backends=BOTH, colour="#e69f00", rescue_base_for=("torch",)),   # KV-Rescue's (arXiv:2608.15797) base policy
    # KeyDiff's colour is Tol's wine: Okabe–Ito's last free hue is bench's best-of-n cells'
    PolicyInfo("keydiff", KeyDiffConfig, KeyDiffPolicy, "per KV head the keys least like the head's mean key "
               "direction + recent tokens, cut every 128 tokens (KeyDiff)", label="KeyDiff", backends=BOTH, colour="#882255"),
    # TriAttention's colour is Tol's indigo; it needs no attention matrix (calibrated query statistics, the keys)
    PolicyInfo("triattention", TriAttentionConfig, TriAttentionPolicy, "per KV head top keys by a trigonometric "
               "series of calibrated pre-RoPE query statistics, the prompt pinned, cut every 128 tokens (TriAttention)",
               label="TriAttention", backends=BOTH, colour="#332288"),
    PolicyInfo("sumr", SumRConfig, SumRPolicy, "prompt + every closed segment's summary + recent tokens "
               "(ZoomR's SumR ablation)", backends=("torch", "llamacpp"), label="SumR", colour="#0072b2"),
    PolicyInfo("zoomr", ZoomRConfig, ZoomRPolicy, "prompt + recent tokens + summaries voted by mean summary keys, "
               "the c most-voted zoomed in (ZoomR)", scores="queries and mean summary keys per layer and head",
               label="ZoomR", colour="#d55e00", backends=BOTH,
               matched_target=True),   # the paper's same-memory comparison
):
    register(_row)

POLICIES = tuple(REGISTRY)  # the shipped policies (policy_names() also lists those registered later)


def policy_info(name: str) -> PolicyInfo:
    """The registry row of ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"--policy {name!r} unknown (choose from {', '.join(REGISTRY)})") from None


def policy_names(backend: str | None = None) -> tuple[str, ...]:
    """Every policy name, in table order; only those ``backend`` implements when given."""
    return tuple(n for n, i in REGISTRY.items() if backend is None or backend in i.backends)


def evicting(backend: str | None = None) -> tuple[str, ...]:
    """The policies that evict (all but :data:`REFERENCE`), only those ``backend`` implements when given."""
    return tuple(n for n in policy_names(backend) if REGISTRY[n].evicts)


def matched_target() -> str:
    """The policy whose measured mean active KV sets the budgets of ``bench --match-budget``'s baselines
    (ZoomR's paper compares its baselines at ZoomR's memory).

    Raises:
        LookupError: no registered policy is the matched target.
    """
    for name, info in REGISTRY.items():
        if info.matched_target:
            return name
    raise LookupError("no registered policy is the matched-budget target")


def rescue_base(backend: str) -> str:
    """KV-Rescue's base policy on ``backend`` when ``--base-policy`` is not given (R-KV, the paper's, where the
    backend exposes attention scores).

    Raises:
        LookupError: no registered policy is ``backend``'s default rescue base.
    """
    for name, info in REGISTRY.items():
        if backend in info.rescue_base_for:
            return name
    raise LookupError(f"no registered policy is the default rescue base on {backend}")


def budgeted() -> tuple[str, ...]:
    """The policies that read ``--budget``."""
    return tuple(n for n, i in REGISTRY.items() if i.budgeted)


def check_backend(name: str, backend: str) -> PolicyInfo:
    """The row of ``name``, if ``backend`` implements it.

    Raises:
        ValueError: an unknown policy, or one the backend does not run (naming what it needs and the
            policies the backend does run).
    """
    info = policy_info(name)
    if backend in info.backends:
        return info
    runs = ", ".join(policy_names(backend))
    other = info.backends[0]
    raise ValueError(f"--policy {name} {missing(name, backend)}; the {backend} backend supports {runs} "
                     f"(use --backend {other} for {name})")


def missing(name: str, backend: str) -> str:
    """Why ``backend`` does not run policy ``name``, as the end of a sentence starting with its name:
    ``has no llamacpp implementation``."""
    policy_info(name)
    return f"has no {backend} implementation"


@dataclass(frozen=True, init=False)
class PolicySpec:
    """A policy by name, the knobs given (the others keep the policy's defaults) and where its K/V lives.

    ``PolicySpec("rkv", 16)``, ``PolicySpec("zoomr", window=16, consensus=1)``; the budget, the knob most
    policies share, may be given by position. Nothing is checked until :meth:`config` or :meth:`build`.

    Attributes:
        name: a :data:`REGISTRY` name.
        knobs: {knob name: value} given (units: see each config; tokens for budget, window, sink).
        offload: ``resident`` or ``stream`` (see :class:`zoomr.kvstore.cache.PolicyKVCache`).
    """

    name: str
    knobs: dict
    offload: str

    def __init__(self, name: str = REFERENCE, budget: int | None = None, *, offload: str = "resident", **knobs):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "knobs", {k: v for k, v in {"budget": budget, **knobs}.items() if v is not None})
        object.__setattr__(self, "offload", offload)

    def with_knobs(self, **knobs) -> "PolicySpec":
        """The same spec with ``knobs`` set (None: back to the policy's default)."""
        merged = {**self.knobs, **knobs}
        return PolicySpec(self.name, offload=self.offload, **merged)

    def config(self) -> PolicyConfig:
        """The policy's config with these knobs.

        Raises:
            ValueError: unknown name, or a knob out of range (one message naming the flag).
            TypeError: a knob this policy does not have (as for an unexpected keyword argument).
        """
        info = policy_info(self.name)
        extra = [k for k in self.knobs if k not in info.knob_names]
        if extra:
            raise TypeError(f"{self.name} has no knob {extra[0]!r} (its knobs: {', '.join(info.knob_names) or 'none'})")
        return info.config(**self.knobs)

    def build(self) -> KVPolicy:
        """A fresh policy for one cache.

        Raises:
            ValueError: see :meth:`config`; an unknown offload mode; knobs that do not fit together.
            TypeError: see :meth:`config`.
        """
        config = self.config()
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload {self.offload!r} unknown (choose from {', '.join(OFFLOAD_MODES)})")
        return config.build()


class PolicyCacheFactory:
    """``cache_factory`` for :class:`zoomr.backends.torch.engine.TorchBackend`: one :class:`PolicyKVCache` per sequence.

    Args:
        spec: the policy options; validated here, before any model is loaded.
    Raises:
        ValueError: see :meth:`PolicySpec.build`.

    Attributes:
        policy_name: the policy with its knobs, e.g. ``zoomr(k=2, c=2, window=512, summaries=auto)``.
        events: :class:`zoomr.kvstore.events.EventBus` every cache made here publishes to.
    """

    def __init__(self, spec: PolicySpec):
        self.spec = spec
        self.policy_name = spec.build().describe() + (" · offloaded" if spec.offload == "stream" else "")
        self.events = EventBus()

    def __call__(self, backend) -> PolicyKVCache:
        cfg = backend.cfg
        return PolicyKVCache(self.spec.build(), cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             backend.device, backend.kv_dtype, self.spec.offload, self.events)


def policy_table_markdown() -> str:
    """docs/policies.md's policy table, rendered from :data:`REGISTRY` (one row per policy, its knobs with defaults)."""
    lines = ["| `--policy` | keeps | knobs: default (source) | budget | attention scores | host store | backends |",
             "|---|---|---|---|---|---|---|"]
    for name, info in REGISTRY.items():
        knobs = " · ".join(_knob_cell(k) for k in info.knobs) or "—"
        lines.append(f"| `{name}` | {info.summary} | {knobs} | {_yes(info.budgeted)} | {info.scores or 'no'} | "
                     f"{_yes(info.host_store)} | {', '.join(info.backends)} |")
    return "\n".join(lines) + "\n"


def _knob_cell(k: Knob) -> str:
    default = "" if k.default is None else str(k.default)
    source = k.info.source if default == "" else (f"({k.info.source})" if k.info.source else "")
    return " ".join(part for part in (f"`{k.flag}`", default, source) if part)


def _yes(flag_value: bool) -> str:
    return "yes" if flag_value else "no"
