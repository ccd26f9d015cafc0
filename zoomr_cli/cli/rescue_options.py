"""The ``--rescue`` flags of ``zoomr solve`` and ``zoomr bench``, declared once; resolved by :mod:`zoomr.rescue.plan`."""

from __future__ import annotations

from typing import Optional

import typer

from zoomr.backends.llamacpp.policies import can_fork
from zoomr.errors import UserError
from zoomr.kvstore.registry import evicting
from zoomr.rescue.plan import RescueOptions

from .options import grouped_options

PANEL = "KV-Rescue (--rescue)"


def _opt(*names: str, help: str, **kw):
    return typer.Option(*names, help=help, rich_help_panel=PANEL, show_default=False, **kw)


_DECLS = {
    "rescue": (bool, _opt("--rescue", help="KV-Rescue: interleave steps of the evicted base (-m) and a "
                          "full-KV helper; each step's best candidate by --prm (default: helper log-likelihood).")),
    "base_policy": (Optional[str], _opt("--base-policy", help=f"Base KV eviction: {', '.join(evicting())} "
                                        f"(llamacpp: {', '.join(p for p in evicting('llamacpp') if can_fork(p))}; "
                                        "default rkv, streaming on "
                                        "llamacpp). Budget: --budget.")),
    "helper": (Optional[str], _opt("--helper", help="Helper model, full KV (default: the embedded model).")),
    "prm": (Optional[str], _opt("--prm", help="Process reward model (HF dir or hub id, Qwen2.5-Math-PRM "
                                "architecture). Default: helper mean log-likelihood (likelihood scorer, no PRM).")),
    "nb": (Optional[int], _opt("--nb", help="Base candidates per step (default 2); 0 runs the helper alone "
                               "(--nb and --nh may not both be 0).")),
    "nh": (Optional[int], _opt("--nh", help="Helper candidates per step (default 2). --nh 0 --no-detector is the "
                               "paper's eviction-only best-of-N baseline.")),
    "step_tokens": (Optional[int], _opt("--step-tokens", help="Most tokens per step (default 512).")),
    "max_steps": (Optional[int], _opt("--max-steps", help="Most committed steps (default 1024).")),
    "abort_entropy": (Optional[float], _opt("--abort-entropy", help="Abort a base candidate when its mean "
                                            "entropy exceeds this (nats, default 7.0).")),
    "entropy_window": (Optional[int], _opt("--entropy-window", help="Tokens in the entropy mean (default 12).")),
    "entropy_guard": (Optional[int], _opt("--entropy-guard", help="Tokens before the entropy test (default 24).")),
    "abort_gzip": (Optional[float], _opt("--abort-gzip", help="Abort when the gzip ratio falls below this "
                                         "(default 0.18).")),
    "gzip_window": (Optional[int], _opt("--gzip-window", help="Characters in the gzip window (default 800).")),
    "abort_repeat": (Optional[int], _opt("--abort-repeat", help="--detector zoomr: abort when, with the gzip window "
                                         "full, this many characters repeat the text one period earlier (default "
                                         "256; 0: off).")),
    "abort_copies": (Optional[int], _opt("--abort-copies", help="--detector zoomr: abort when the text ends in this "
                                         "many copies of one unit, digits read alike, or half as many covering 256 "
                                         "characters (a count; default 64; 0: off).")),
    "detector": (Optional[str], _opt("--detector", help="Degeneration detector: zoomr (default; calibrated: gzip "
                                     "threshold scaled to the window's fill, cycle rules) or paper (KV-Rescue's as "
                                     "stated: entropy > 7.0, gzip < 0.18 over 800 characters).", metavar="zoomr|paper")),
    "early_exit": (Optional[bool], _opt("--early-exit/--no-detector", help="Abort degenerate base candidates early "
                                        "(default on; --no-detector keeps every candidate, signals still shown).")),
    "preset": (Optional[str], _opt("--preset", help="Rescue preset from configs/rescue_NAME.toml, e.g. paper.")),
}


def rescue_options(fn):
    """Decorator: add the KV-Rescue flags to a Typer command; the command receives ``rescue: RescueOptions``.

    Stack it under :func:`zoomr.cli.options.model_options` (which supplies ``opts``).
    """
    defaults = {name: getattr(RescueOptions(), name) for name in _DECLS}
    return grouped_options(fn, "rescue", _DECLS, defaults,
                           lambda values, typed: needs_rescue(RescueOptions(**values)))


def needs_rescue(ropts: RescueOptions) -> RescueOptions:
    """``ropts`` unchanged when its flags make sense together.

    Raises:
        UserError: a KV-Rescue flag given without ``--rescue`` (it would silently do nothing).
    """
    if not ropts.rescue:
        for name in _DECLS:
            value = getattr(ropts, name)
            if name != "rescue" and value is not None:
                flag = "--no-detector" if value is False else "--" + name.replace("_", "-")
                raise UserError(f"{flag} needs --rescue")
    return ropts
