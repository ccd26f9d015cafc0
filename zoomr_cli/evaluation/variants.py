"""Cells with knobs of their own: ``--policies full,zoomr:window=256,snapkv``.

A bench's ``--window 256`` sets the window of every policy that has one. A *variant* is a policy name followed
by ``:knob=value`` pairs (``zoomr:window=256``, ``zoomr:window=128:segment-tokens=64``) whose knobs apply to
that cell alone, over the bench-wide ones; the same policy may then run with several settings in one bench
(``zoomr,zoomr:window=256``). Knob names are the flags without their dashes (``segment-tokens`` or
``segment_tokens``); values are parsed as the flag parses them and checked against the knob's range when the
bench validates its cells, before any model loads.

A variant's *label* is its canonical spelling (knob names as flags, in the policy's declaration order:
``zoomr:window=128:segment-tokens=64`` whatever order was typed): the label is the cell's name in records
(``policy``), tables, plots and ``--resume``. Each record of a variant also carries ``cell_knobs``
({knob: value}); a plain policy's label is its name and its records are as before.

The budget is not a cell knob: ``--budget`` and ``--match-budget`` size every budgeted cell.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from zoomr.errors import UserError
from zoomr.kvstore.knobs import flag
from zoomr.kvstore.registry import REGISTRY, policy_info, policy_names
from zoomr.options import RunOptions

SEP = ":"


@dataclass(frozen=True)
class Variant:
    """One cell's policy and its own knobs.

    Attributes:
        label: the canonical spelling (the cell's name in records, tables and plots).
        policy: the registry name (``zoomr``).
        knobs: ((knob name, value), ...) in the policy's declaration order; empty for a plain policy.
    """

    label: str
    policy: str
    knobs: tuple[tuple[str, Any], ...] = ()

    def options(self, opts: RunOptions) -> RunOptions:
        """``opts`` running this cell: its policy, and its knobs over the bench-wide ones."""
        return replace(opts, policy=self.policy).with_knobs(**dict(self.knobs))


def _value(policy: str, name: str, text: str, spelled: str):
    """``text`` as knob ``name``'s type (int knobs: a whole number of tokens), range-checked.

    Raises:
        UserError: not a value of that type, or out of the knob's range (naming the cell).
    """
    knob = next(k for k in policy_info(policy).knobs if k.name == name)
    try:
        value = knob.type(text) if knob.type is not str else text
    except ValueError:
        raise UserError(f"--policies {spelled}: {name.replace('_', '-')} must be {'an integer' if knob.type is int else 'a number'}, "
                        f"got {text!r}") from None
    try:
        knob.info.check(flag(name), value)
    except ValueError as e:
        raise UserError(f"--policies {spelled}: {e}") from None
    return value


@lru_cache(maxsize=None)
def parse_variant(text: str) -> Variant:
    """``policy[:knob=value]...`` as a :class:`Variant`.

    Raises:
        UserError: an unknown policy, an empty or malformed pair, a knob the policy does not have (naming
            the ones it has), ``budget``, a knob given twice, a value of the wrong type or out of range.
    """
    spelled = text.strip()
    name, *pairs = spelled.split(SEP)
    name = name.strip()
    if name not in REGISTRY:
        raise UserError(f"--policies: unknown {name or spelled!r} (choose from {', '.join(policy_names())})")
    if not pairs:
        return Variant(name, name)
    info = policy_info(name)
    own = [k for k in info.knob_names if k != "budget"]
    given: dict[str, Any] = {}
    for pair in pairs:
        key, eq, text_value = (s.strip() for s in pair.partition("="))
        if not eq or not key or not text_value:
            raise UserError(f"--policies {spelled}: {pair!r} is not knob=value (as in zoomr:window=256)")
        knob = key.replace("-", "_")
        if knob == "budget":
            raise UserError(f"--policies {spelled}: the budget is not a cell knob (--budget or --match-budget "
                            "sizes every budgeted cell)")
        if knob not in own:
            have = ", ".join(k.replace("_", "-") for k in own) or "none"
            raise UserError(f"--policies {spelled}: {name} has no knob {key!r} (its knobs: {have})")
        if knob in given:
            raise UserError(f"--policies {spelled}: {key} given twice")
        given[knob] = _value(name, knob, text_value, spelled)
    knobs = tuple((k, given[k]) for k in own if k in given)
    label = SEP.join([name] + [f"{k.replace('_', '-')}={v}" for k, v in knobs])
    return Variant(label, name, knobs)


def is_variant_label(name: str) -> bool:
    """Whether ``name`` is a policy or a variant of one (rescue cells' names are neither)."""
    return name.split(SEP, 1)[0].strip() in REGISTRY


def base_of(name: str) -> str:
    """The policy of a cell label (``zoomr`` for ``zoomr:window=256``); any other cell name unchanged."""
    return name.split(SEP, 1)[0].strip() if is_variant_label(name) else name


def cell_knob_fields(name: str) -> dict:
    """The record fields a cell adds for its own knobs: ``{"cell_knobs": {...}}`` for a variant, else {}
    (plain policies and rescue cells)."""
    if not is_variant_label(name):
        return {}
    v = parse_variant(name)
    return {"cell_knobs": dict(v.knobs)} if v.knobs else {}
