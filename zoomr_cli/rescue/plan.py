"""KV-Rescue settings: flags, preset and defaults resolved into a :class:`RescuePlan` before any model loads.

:func:`plan_rescue` resolves them (command line, then ``--preset``, then :data:`DEFAULTS`) and checks
everything it can before any model is loaded.

Defaults follow the KV-Rescue paper (arXiv:2608.15797) except the candidate counts: N_b = N_h = 2
instead of the paper's 8 (its main results use N ∈ {1, 8}), because every candidate is decoded one
after another and on a CPU each costs seconds; ``--preset paper`` sets the paper's models and 8 + 8; and the
degeneration detector, zoomr's calibrated one unless ``--detector paper`` (:mod:`zoomr.rescue.detectors`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from zoomr.backends.models import resolve_model
from zoomr.errors import UserError
from zoomr.factory import check_forks, check_policy
from zoomr.kvstore.registry import BACKENDS, REFERENCE, REGISTRY, evicting, missing, rescue_base
from zoomr.options import RunOptions, check_knobs_read

from .degeneration import DetectorConfig
from .detectors import check_detector
from .loop import RescueConfig

# values used when neither the command line nor a preset sets them (paper, except nb/nh: see above)
DEFAULTS = {"nb": 2, "nh": 2, "step_tokens": 512, "max_steps": 1024, "abort_entropy": 7.0, "entropy_window": 12,
            "entropy_guard": 24, "abort_gzip": 0.18, "gzip_window": 800, "abort_repeat": 256,
            "abort_copies": 64, "detector": "zoomr", "early_exit": True}
# the thresholds only zoomr's detector reads (--detector paper has no cycle rule)
ZOOMR_ONLY = {"abort_repeat": "--abort-repeat", "abort_copies": "--abort-copies"}


@dataclass
class RescueOptions:
    """The ``--rescue`` family of flags; None = not given (a preset or :data:`DEFAULTS` decides)."""

    rescue: bool = False
    base_policy: Optional[str] = None
    helper: Optional[str] = None
    prm: Optional[str] = None
    nb: Optional[int] = None
    nh: Optional[int] = None
    step_tokens: Optional[int] = None
    max_steps: Optional[int] = None
    abort_entropy: Optional[float] = None
    entropy_window: Optional[int] = None
    entropy_guard: Optional[int] = None
    abort_gzip: Optional[float] = None
    gzip_window: Optional[int] = None
    abort_repeat: Optional[int] = None
    abort_copies: Optional[int] = None
    detector: Optional[str] = None       # which detector: zoomr (calibrated) or paper (zoomr.rescue.detectors)
    early_exit: Optional[bool] = None    # False: --no-detector (signals computed, nothing aborted)
    preset: Optional[str] = None


def load_preset(name: str | None) -> dict:
    """The ``[rescue]`` table of ``configs/rescue_<name>.toml`` ({} for None).

    Raises:
        UserError: no such preset.
    """
    if name is None:
        return {}
    from zoomr.configs import load

    try:
        return load(f"rescue_{name}").get("rescue", {})
    except FileNotFoundError:
        raise UserError(f"--preset {name!r}: no configs/rescue_{name}.toml") from None


@dataclass
class RescuePlan:
    """Everything resolved from the flags: the loop config, each model's run options, the PRM."""

    config: RescueConfig
    base_opts: RunOptions
    helper_opts: RunOptions
    prm: str | None
    notes: list[str]


def plan_rescue(ropts: RescueOptions, opts: RunOptions) -> RescuePlan:
    """Resolve flags, preset and defaults; validate before any model is loaded.

    The base policy is any evicting policy of the registry (:func:`zoomr.kvstore.registry.evicting`);
    one the backend does not run is refused with the registry's reason.

    Raises:
        UserError: ``--policy`` used with ``--rescue``, an unknown base policy, an unknown preset, a policy
            knob the base policy does not read, an unknown ``--detector``, a threshold given that the chosen
            detector does not read (``--abort-repeat``/``--abort-copies`` with ``--detector paper``).
        ValueError: bad counts or thresholds (see :meth:`RescueConfig.validate`).
    """
    preset = load_preset(ropts.preset)

    def pick(name: str):
        given = getattr(ropts, name)
        return given if given is not None else preset.get(name, DEFAULTS.get(name))

    if opts.policy != REFERENCE:
        raise UserError(f"--policy {opts.policy}: with --rescue the base's eviction is --base-policy "
                        "(the helper always keeps full KV)")
    notes = []
    policy = pick("base_policy")
    if policy is None:
        policy = rescue_base(opts.backend)
        paper = rescue_base(BACKENDS[0])   # the paper's base (R-KV), on the backend that runs every policy
        if policy != paper and opts.backend in REGISTRY[paper].backends:
            notes.append(f"base policy {policy}, the {opts.backend} default: {REGISTRY[paper].display} runs here "
                         f"with one selection shared by every layer and head (--base-policy {paper})")
        elif policy != paper:
            notes.append(f"base policy {policy}: {REGISTRY[paper].display} {missing(paper, opts.backend)}")
    choices = ", ".join(evicting(opts.backend))
    if policy == REFERENCE:
        raise UserError(f"--base-policy {REFERENCE}: the base must evict (the helper is the full-KV model); "
                        f"choose from {choices}")
    if policy not in REGISTRY:
        raise UserError(f"--base-policy {policy!r} unknown (choose from {choices})")
    name = pick("detector")
    try:
        check_detector(name)
    except ValueError as e:
        raise UserError(str(e)) from None
    unread = [flag for key, flag in ZOOMR_ONLY.items() if name != "zoomr" and getattr(ropts, key) is not None]
    if unread:
        raise UserError(f"{unread[0]} is read by --detector zoomr only (--detector {name} has no cycle rule)")
    detector = DetectorConfig(pick("abort_entropy"), pick("entropy_window"), pick("entropy_guard"),
                              pick("abort_gzip"), pick("gzip_window"), pick("abort_repeat"),
                              pick("abort_copies"), name=name)
    config = RescueConfig(pick("nb"), pick("nh"), pick("step_tokens"), pick("max_steps"), opts.ctx_size,
                          max_new_tokens=opts.n_predict, detector=detector, early_exit=pick("early_exit")).validate()
    model = opts.model if opts.model is not None else preset.get("model")
    base_opts = dataclasses.replace(opts, model=model, policy=policy)
    # the knobs are the base's: the helper keeps full KV
    helper_opts = dataclasses.replace(opts, model=pick("helper"), policy=REFERENCE, knobs={})
    # a bad policy knob, a missing helper or PRM should fail now, not after a model has loaded
    for_flag("--base-policy", check_policy, base_opts)
    for_flag("--base-policy", check_forks, base_opts)
    check_knobs_read(base_opts, "--base-policy")
    for_flag("-m", resolve_model, model)
    for_flag("--helper", resolve_model, helper_opts.model)
    if pick("prm") is not None:
        for_flag("--prm", resolve_model, pick("prm"))
    return RescuePlan(config, base_opts, helper_opts, pick("prm"), notes)


def for_flag(flag: str, build, *args):
    """Build or resolve one model; a bad model becomes a one-line UserError naming its flag."""
    try:
        return build(*args)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None
