"""Which cells a bench runs and whether their knobs hold, decided from the policy registry before any model loads.

A cell is (policy, budget): budget None for a policy that sizes itself (full, SumR, ZoomR), a number of
tokens for a budgeted one, :data:`MATCHED` for a baseline whose budget follows ZoomR's measured KV. Every
knob given applies to the policies whose config has it, and only to those (:func:`zoomr.options.knob_scope`);
a cell's policy may carry knobs of its own (``zoomr:window=256``, :mod:`zoomr.evaluation.variants`), which
win over the bench-wide ones for that cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from zoomr.errors import UserError
from zoomr.factory import check_knob_sizes, check_lengths, torch_cache_factory
from zoomr.kvstore.registry import REFERENCE, budgeted, knob_flags, matched_target, policy_info, policy_names
from zoomr.options import RunOptions, knob_scope, not_read
from zoomr.rescue.plan import RescueOptions

from zoomr.evaluation.bench_cells import cell_policy
from zoomr.evaluation.datasets import Problem, load_problems
from zoomr.evaluation.records import MATCHED  # the record format owns the value
from zoomr.evaluation.rescue_cells import RescueCells
from zoomr.evaluation.rescue_cells import plan as plan_rescue_cells
from zoomr.evaluation.variants import parse_variant


def plan_cells(policies: list[str], budgets: list[int], matched: bool = False) -> list[tuple[str, int | str | None]]:
    """(policy, budget) cells per problem: full first (the fidelity reference), then every policy that sizes
    itself once, then every budgeted one at each of ``budgets`` (tokens), or once at :data:`MATCHED`.
    ``policies`` are cell labels (a policy, or a variant such as ``snapkv:window=32``).

    Raises:
        ValueError / UserError: an unknown policy or variant.
    """
    sized = [p for p in policies if policy_info(parse_variant(p).policy).budgeted]
    cells: list[tuple[str, int | str | None]] = [(REFERENCE, None)]
    cells += [(p, None) for p in policies if p != REFERENCE and p not in sized]
    if matched:
        return cells + [(p, MATCHED) for p in sized]
    return cells + [(p, b) for b in budgets for p in sized]


def validate_cells(cells: list[tuple[str, object]], opts: RunOptions, rescue_base: str | None = None) -> dict:
    """Build every cell's policy once, before the first cell runs, so a bad (policy, budget, knob) stops the
    bench at once instead of after hours of finished cells. A matched cell is checked at the largest budget
    (``-c``): its budget is chosen later inside the range its knobs allow.

    Args:
        cells: as :func:`plan_cells` makes them, plus any rescue cells (named by a non-policy name).
        opts: the bench's options; each cell's policy reads only the knobs it has.
        rescue_base: the rescue cells' base policy (checked at each rescue cell's budget); None: no rescue.
    Returns:
        {:func:`cell_policy` of a cell with a fixed budget: its torch cache factory (None: full KV)}: the
        validated build each problem's run of the cell reuses (a factory makes a fresh policy per sequence).
    Raises:
        UserError: the first cell whose policy rejects its knobs, naming the cell.
    """
    factories = {}
    for name, budget in cells:
        key = cell_policy(name, budget, rescue_base)
        if key is None or key in factories:   # rescue and best-of-n share the base at one budget
            continue
        label, knob = key
        cell = parse_variant(label).options(opts)
        if knob is not None:
            cell = cell.with_knobs(budget=opts.ctx_size if knob == MATCHED else knob)
        try:
            factory = torch_cache_factory(cell)
        except ValueError as e:
            label = name + ("" if budget is None else f" B={budget}")
            raise UserError(f"cell {label}: {e}") from None
        if knob != MATCHED:   # a matched cell's budget is chosen per problem: built again then
            factories[key] = factory
    return factories


@dataclass
class BenchPlan:
    """A bench checked before any model loads: what runs (cells per problem), on what, where to.

    Attributes:
        policies: the cell labels compared (policies or variants, :mod:`zoomr.evaluation.variants`); cells:
            (label, budget) per problem, rescue cells included; target: the matched target's cell label
            (the first of ``policies`` that is ZoomR or a variant of it; None: none runs).
        factories: each fixed-budget cell's validated cache factory (built once for the whole bench).
        config: the settings ``config.json`` records (a resume must not change them).
    """

    opts: RunOptions
    policies: list[str]
    cells: list
    factories: dict
    sampling: object
    dataset: str
    problems: list[Problem]
    out: Path
    config: dict
    scope: list[str]
    fidelity: bool
    n_parallel: int
    rescue_plan: object = None
    target: str | None = None

    @property
    def rescue_base(self) -> str | None:
        return None if self.rescue_plan is None else self.rescue_plan.base_opts.policy


def plan_bench(opts: RunOptions, policies: Sequence[str], budgets: Sequence[int] | None, *, dataset: str,
               limit: int | None, out: str | Path | None, match_budget: bool, fidelity: bool, n_parallel: int,
               rescue: RescueOptions | None) -> BenchPlan:
    """Check everything known before a model loads and build each cell's policy once (the arguments of
    :func:`zoomr.evaluation.runner.bench`).

    Raises:
        UserError / ValueError: see :func:`zoomr.evaluation.runner.bench`.
    """
    names = policy_names()
    if not list(policies):
        raise UserError(f"--policies: give at least one of {', '.join(names)}")
    bad = [p for p in policies if p.split(":", 1)[0].strip() not in names]
    if bad:
        raise UserError(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(names)})")
    variants = [parse_variant(p) for p in policies]
    chosen = [v.label for v in variants]
    twice = sorted({p for p in chosen if chosen.count(p) > 1})
    if twice:
        raise UserError(f"--policies: {', '.join(twice)} given more than once (each policy runs once per budget)")
    bases = list(dict.fromkeys(v.policy for v in variants))
    if opts.backend != "torch":
        raise UserError("zoomr bench compares policies on the torch backend (--backend torch)")
    if n_parallel < 1:
        raise UserError(f"-np must be >= 1 parallel sequence, got {n_parallel}")
    check_lengths(opts)
    sizes = sorted(set(budgets or [knob_flags()["budget"].default]))
    if min(sizes) < 1:
        raise UserError(f"--budget must be at least 1 token, got {min(sizes)}")
    target = matched_target()
    if match_budget and budgets:
        raise UserError(f"--match-budget chooses each baseline's budget from {target}'s measured KV: drop --budget")
    if budgets and rescue is None and not set(bases) & set(budgeted()):
        raise UserError(not_read("--budget", budgeted()))
    if budgets:   # a budget given (the default 64 is no user's choice: a tiny -c with full alone is fine)
        check_knob_sizes(opts.with_knobs(budget=max(sizes)))
    if match_budget and target not in bases:
        raise UserError(f"--match-budget needs {target} among --policies (its measured KV sets the budget)")
    sampling = opts.sampling(default_temp=0.0)
    name, problems = load_problems(dataset, limit)
    config = {"dataset": name, "model": opts.model or "default", "backend": opts.backend, "dtype": opts.dtype,
              "quant": opts.quant, "kv_dtype": opts.kv_dtype, "compile": opts.compile, "n_predict": opts.n_predict,
              "ctx_size": opts.ctx_size, "sampling": vars(sampling), "ignore_eos": opts.ignore_eos,
              "match_budget": match_budget, "fidelity": fidelity,
              "policy_knobs": {k: opts.knob(k) for k in knob_flags() if k != "budget"}}
    rescue_plan = None
    if rescue is not None:
        rescue_plan, config["rescue"] = plan_rescue_cells(rescue, opts)
    cells = plan_cells(chosen, sizes, matched=match_budget)
    rescue_base = None
    if rescue_plan is not None:
        cells += RescueCells.cells([MATCHED] if match_budget else sizes)
        rescue_base = rescue_plan.base_opts.policy
    # a knob no policy reads is named as such, before any cell is built
    scope = knob_scope(bases + ([rescue_base] if rescue_base else []), opts)
    factories = validate_cells(cells, opts, rescue_base)
    folder = Path(out) if out is not None else Path(f"bench_out/{Path(name).name.replace('/', '_')}")
    target_cell = next((v.label for v in variants if v.policy == target), None)
    return BenchPlan(opts, chosen, cells, factories, sampling, name, problems, folder, config, scope, fidelity,
                     n_parallel, rescue_plan, target_cell)
