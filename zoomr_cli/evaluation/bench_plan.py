"""Which cells a bench runs and whether their knobs hold, decided from the policy registry before any model loads.

A cell is (policy, budget): budget None for a policy that sizes itself (full, SumR, ZoomR), a number of
tokens for a budgeted one, :data:`MATCHED` for a baseline whose budget follows ZoomR's measured KV. Every
knob given applies to the policies whose config has it, and only to those (:func:`zoomr.options.knob_scope`).
"""

from __future__ import annotations

from dataclasses import replace

from zoomr.errors import UserError
from zoomr.factory import torch_cache_factory
from zoomr.kvstore.registry import REFERENCE, REGISTRY, policy_info
from zoomr.options import RunOptions

from zoomr.evaluation.records import MATCHED  # the record format owns the value


def plan_cells(policies: list[str], budgets: list[int], matched: bool = False) -> list[tuple[str, int | str | None]]:
    """(policy, budget) cells per problem: full first (the fidelity reference), then every policy that sizes
    itself once, then every budgeted one at each of ``budgets`` (tokens), or once at :data:`MATCHED`.

    Raises:
        ValueError: an unknown policy.
    """
    sized = [p for p in policies if policy_info(p).budgeted]
    cells: list[tuple[str, int | str | None]] = [(REFERENCE, None)]
    cells += [(p, None) for p in policies if p != REFERENCE and p not in sized]
    if matched:
        return cells + [(p, MATCHED) for p in sized]
    return cells + [(p, b) for b in budgets for p in sized]


def validate_cells(cells: list[tuple[str, object]], opts: RunOptions, rescue_base: str | None = None) -> None:
    """Build every cell's policy once, before the first cell runs, so a bad (policy, budget, knob) stops the
    bench at once instead of after hours of finished cells. A matched cell is checked at the largest budget
    (``-c``): its budget is chosen later inside the range its knobs allow.

    Args:
        cells: as :func:`plan_cells` makes them, plus any rescue cells (named by a non-policy name).
        opts: the bench's options; each cell's policy reads only the knobs it has.
        rescue_base: the rescue cells' base policy (checked at each rescue cell's budget); None: no rescue.
    Raises:
        UserError: the first cell whose policy rejects its knobs, naming the cell.
    """
    for name, budget in cells:
        policy = name if name in REGISTRY else rescue_base
        if policy is None:
            continue
        cell = replace(opts, policy=policy)
        if budget is not None and policy_info(policy).budgeted:
            cell = cell.with_knobs(budget=opts.ctx_size if budget == MATCHED else budget)
        try:
            torch_cache_factory(cell)
        except ValueError as e:
            label = name + ("" if budget is None else f" B={budget}")
            raise UserError(f"cell {label}: {e}") from None
