"""Policy knobs: each policy's frozen config dataclass declares its own, with :func:`knob`.

A knob is a config field whose metadata says what it means, its valid range and where its default
comes from (paper or reference code). The registry (:mod:`zoomr.kvstore.registry`) turns every knob of
every config into one command-line flag (``window`` → ``--window``), so a policy that adds a knob adds
a flag. Two policies that both have a knob share its flag, so they must agree on its type and range.

Range checks run when a config is made and name the flag (``--window must be at least 1 token, got
0``); checks that involve several knobs stay in the policy's constructor, which :meth:`PolicyConfig.build`
calls.
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from .segments import SUMMARY_MODES


@dataclass(frozen=True)
class KnobInfo:
    """What a knob means and accepts (the metadata :func:`knob` attaches to a config field).

    Attributes:
        help: one line for ``--help`` and docs/policies.md, e.g. "attention-sink tokens kept at the start".
        minimum: the smallest value accepted (numbers), or None.
        choices: the values accepted (strings), or None.
        tokens: the knob counts tokens (error messages say "token").
        source: where the default comes from, e.g. "StreamingLLM"; for a default of None, how the
            policy computes it (e.g. "B − sink").
    """

    help: str
    minimum: float | None = None
    choices: tuple[str, ...] | None = None
    tokens: bool = False
    source: str = ""

    def check(self, flag: str, value: Any) -> None:
        """Raise ``ValueError`` naming ``flag`` when ``value`` is out of range (None = the policy's default)."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{flag} {value!r} unknown (choose from {', '.join(self.choices)})")
        if self.minimum is not None and value < self.minimum:
            unit = (" token" if self.minimum == 1 else " tokens") if self.tokens else ""
            raise ValueError(f"{flag} must be at least {self.minimum:g}{unit}, got {value}")


def knob(default: Any, help: str, *, minimum: float | None = None, choices: tuple[str, ...] | None = None,
         tokens: bool = False, source: str = "") -> Any:
    """A config field that is a policy knob (see :class:`KnobInfo` for the arguments)."""
    return dataclasses.field(default=default, metadata={"knob": KnobInfo(help, minimum, choices, tokens, source)})


def budget_knob(source: str = "") -> Any:
    """``--budget``: B, the positions an evicting policy keeps (tokens, ≥ 1; default 64)."""
    return knob(64, "KV budget B: positions kept after an eviction (tokens)", minimum=1, tokens=True, source=source)


def window_knob(default: int | None, source: str, help: str = "recent window w: newest positions always kept "
                "(tokens)") -> Any:
    """``--window``: the recent positions a policy always keeps (tokens, ≥ 1)."""
    return knob(default, help, minimum=1, tokens=True, source=source)


SELECTIONS = ("per-head", "shared")   # see zoomr.kvstore.policy.ScoredPolicy


def selection_knob() -> Any:
    """``--selection``: per-head (each layer and KV head keeps its own positions) or shared (one set for all)."""
    return knob(None, "per-head: every layer and KV head keeps its own positions (the papers'); shared: one set of "
                "positions for all of them, the only choice llama.cpp's KV cells allow (default: per-head on "
                "--backend torch, shared on --backend llamacpp)", choices=SELECTIONS,
                source="per-head on torch, shared on llamacpp")


def summaries_knob() -> Any:
    """``--summaries``: how segments are found (see :mod:`zoomr.kvstore.segments`)."""
    return knob("auto", "segments: model (delimiters the model writes), prompted, auto (bounded blocks when none "
                "appear)", choices=SUMMARY_MODES, source="for models not fine-tuned to summarize")


def segment_tokens_knob(default: int, source: str) -> Any:
    """``--segment-tokens``: the longest block of ``--summaries auto``/``prompted``, and the most tokens between
    two recomputes in any mode (tokens, ≥ 1; :class:`zoomr.kvstore.segments.RecomputeClock`)."""
    return knob(default, "longest segment when the model writes no summaries: blocks close at a paragraph end "
                "from a third of it, else are cut at a sentence or line end by this length; also the most "
                "tokens between two recomputes; a summary the model writes must close within 4× it, else blocks are "
                "cut (tokens)", minimum=1,
                tokens=True, source=source)


@dataclass(frozen=True)
class Knob:
    """One knob of one config: name, command-line flag, value type (``int``, ``str`` ...), default, info."""

    name: str
    type: type
    default: Any
    info: KnobInfo

    @property
    def flag(self) -> str:
        """The command-line flag: ``topk_per_head`` → ``--topk-per-head``."""
        return flag(self.name)


def flag(name: str) -> str:
    """A knob's command-line flag: ``topk_per_head`` → ``--topk-per-head``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class PolicyConfig(abc.ABC):
    """Base of every policy's config: a frozen dataclass of its knobs, checked when made.

    Subclasses declare fields with :func:`knob` (every field must be a knob) and implement :meth:`build`.

    Raises:
        ValueError: a knob out of its range (on construction), naming the flag.
    """

    def __post_init__(self):
        for k in knobs_of(type(self)):
            k.info.check(k.flag, getattr(self, k.name))

    @abc.abstractmethod
    def build(self):
        """A fresh :class:`zoomr.kvstore.policy.KVPolicy` with these knobs (each policy's file defines it).

        Raises:
            ValueError: knobs that do not fit together (the policy's constructor says which).
        """


def knobs_of(config: type[PolicyConfig]) -> tuple[Knob, ...]:
    """The knobs of a config class, in declaration order.

    Raises:
        TypeError: a field declared without :func:`knob`.
    """
    hints = typing.get_type_hints(config)  # the policy modules defer annotations
    out = []
    for f in dataclasses.fields(config):
        info = f.metadata.get("knob")
        if info is None:
            raise TypeError(f"{config.__name__}.{f.name}: declare policy knobs with kvstore.knobs.knob()")
        out.append(Knob(f.name, _value_type(hints[f.name]), f.default, info))
    return tuple(out)


def _value_type(hint) -> type:
    """``int | None`` → ``int``: the type a flag parses (None means "the policy's default")."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
