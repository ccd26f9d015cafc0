"""The policy registry: one table that every list of policies and knobs derives from.

* each row agrees with its class, config and backends; knob ranges name their flag;
* docs/policies.md's policy table is exactly what the registry renders;
* an 8th policy registered here (with a knob nobody else has) reaches the CLI options, the factory,
  bench's cells and knob checks, rescue's base choices and the llama.cpp check with no other edit;
* bench checks every cell's knobs before any runs, each policy reading only its own knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import typer
from typer.testing import CliRunner

from conftest import ROOT
from zoomr.backends.llamacpp.policies import CELL_POLICIES, make_policy
from zoomr.cli.options import knob_options, model_options
from zoomr.errors import UserError
from zoomr.evaluation.bench_plan import plan_cells, validate_cells
from zoomr.factory import check_policy, policy_spec, torch_cache_factory
from zoomr.kvstore.cache import PolicyKVCache
from zoomr.kvstore.knobs import PolicyConfig, budget_knob, knob
from zoomr.kvstore.policy import ForwardInfo, KVPolicy
from zoomr.evaluation.plots import FALLBACK_COLOURS, policy_colour
from zoomr.kvstore.registry import (REFERENCE, REGISTRY, PolicyInfo, PolicySpec, budgeted, check_backend, evicting,
                                    knob_flags, matched_target, policy_names, policy_table_markdown, register,
                                    rescue_base)
from zoomr.options import RunOptions, knob_scope
from zoomr.rescue.plan import RescueOptions, plan_rescue


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_row_matches_its_class_config_and_backends(name):
    info = REGISTRY[name]
    policy = info.config().build()  # the defaults are valid
    assert type(policy) is info.policy and policy.name == name and policy.describe().startswith(name)
    assert info.budgeted == (policy.budget is not None)
    # llama.cpp has cell operations only: a policy that ranks by attention cannot run there
    assert ("llamacpp" in info.backends) == (info.config in CELL_POLICIES)
    assert ("llamacpp" in info.backends) or name == "zoomr"   # the one that zooms evicted positions back in
    assert "torch" in info.backends and info.summary and info.evicts == (name != REFERENCE)
    for k in info.knobs:
        assert k.info.help and (k.default is not None or k.info.source), k  # a computed default says how


@pytest.mark.parametrize("name,knob_name", [(n, k.name) for n, i in REGISTRY.items() for k in i.knobs
                                            if k.info.minimum is not None or k.info.choices])
def test_a_knob_out_of_range_is_one_value_error_naming_its_flag(name, knob_name):
    k = next(k for k in REGISTRY[name].knobs if k.name == knob_name)
    bad = "bogus" if k.info.choices else k.info.minimum - 1
    with pytest.raises(ValueError, match=k.flag):
        PolicySpec(name, **{knob_name: bad}).build()


def test_shipped_table_and_derived_lists():
    assert policy_names() == ("full", "streaming", "h2o", "snapkv", "rkv", "keydiff", "triattention", "sumr", "zoomr")
    assert budgeted() == ("streaming", "h2o", "snapkv", "rkv", "keydiff", "triattention")
    assert policy_names("llamacpp") == policy_names()   # every shipped policy runs on both backends
    assert evicting("llamacpp") == ("streaming", "h2o", "snapkv", "rkv", "keydiff", "triattention", "sumr", "zoomr")
    assert REFERENCE not in evicting()
    flags = knob_flags()
    assert flags["window"].readers == ("streaming", "h2o", "snapkv", "rkv", "keydiff", "sumr", "zoomr")
    assert flags["window"].default is None            # the readers differ: each keeps its own
    assert (flags["budget"].default, flags["sink"].default, flags["summaries"].default) == (64, 4, "auto")
    assert flags["sink"].readers == ("streaming",) and flags["topk_per_head"].flag == "--topk-per-head"
    with pytest.raises(TypeError, match="full has no knob 'budget'"):
        PolicySpec("full", 16).build()  # a knob is its policy's: no flat bag


def test_docs_policy_page_shows_the_table_the_registry_renders():
    table = policy_table_markdown()
    page = (ROOT / "docs" / "policies.md").read_text()
    assert table in page, "docs/policies.md's policy table is stale: paste policy_table_markdown() over it"
    assert len(table.strip().splitlines()) == 2 + len(REGISTRY)


def test_the_registry_answers_every_policy_role():
    # a fixed colour per shipped policy, all different, and the plots draw each in it
    assert all(len(i.colour) == 7 and i.colour.startswith("#") for i in REGISTRY.values())
    assert len({i.colour for i in REGISTRY.values()}) == len(REGISTRY)
    assert all(policy_colour(name) == info.colour for name, info in REGISTRY.items())
    assert matched_target() == "zoomr"
    assert (rescue_base("torch"), rescue_base("llamacpp")) == ("rkv", "streaming")
    # llama.cpp implements exactly the policies the registry lists for it (its factories keyed by config class)
    assert {REGISTRY[n].config for n in policy_names("llamacpp")} == set(CELL_POLICIES)
    assert [n for n, i in REGISTRY.items() if not i.evicts] == [REFERENCE]


def test_register_refuses_a_row_that_disagrees():
    @dataclass(frozen=True)
    class TextWindow(PolicyConfig):
        window: str = knob("x", "a window that is not a number of tokens")

    class Other(KVPolicy):
        name = "other"

    with pytest.raises(ValueError, match="--window must have the type and range"):
        register(PolicyInfo("other", TextWindow, Other, "test"))
    with pytest.raises(ValueError, match="its class is named 'other'"):
        register(PolicyInfo("another", TextWindow, Other, "test"))
    with pytest.raises(ValueError, match="registered already"):
        register(REGISTRY["rkv"])
    assert "other" not in REGISTRY and "another" not in REGISTRY


# --- an 8th policy, defined here: the newest B positions plus every stride-th older one -------------------------

class StridePolicy(KVPolicy):
    """Keeps the newest ``budget`` positions and every ``stride``-th older one."""

    name = "stride"

    def __init__(self, budget: int, stride: int):
        self.budget, self.stride, self.slack = budget, stride, 1

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        n = fwd.end
        if n <= self.budget:
            return None
        keep = torch.cat([torch.arange(0, n - self.budget, self.stride), torch.arange(n - self.budget, n)])
        return keep.expand(self.ctx.n_kv_heads, -1)

    def describe(self) -> str:
        return f"stride(B={self.budget}, stride={self.stride})"


@dataclass(frozen=True)
class StrideConfig(PolicyConfig):
    budget: int = budget_knob()
    stride: int = knob(8, "keep every stride-th position older than the budget", minimum=1, source="test")

    def build(self) -> StridePolicy:
        return StridePolicy(self.budget, self.stride)


@pytest.fixture
def stride():
    info = register(PolicyInfo("stride", StrideConfig, StridePolicy, "the newest B + every stride-th older (test)"))
    yield info
    del REGISTRY["stride"]


def test_a_policy_role_is_claimed_once(stride):
    del REGISTRY["stride"]
    with pytest.raises(ValueError, match="zoomr is the matched-budget target already"):
        register(replace(stride, matched_target=True))
    with pytest.raises(ValueError, match="rkv is the default rescue base on torch already"):
        register(replace(stride, rescue_base_for=("torch",)))
    with pytest.raises(ValueError, match="must evict and run there"):
        register(replace(stride, rescue_base_for=("llamacpp",)))
    assert "stride" not in REGISTRY
    register(stride)   # the fixture removes it again
    assert stride.colour == "" and policy_colour("stride") in FALLBACK_COLOURS


def test_a_policy_one_backend_lacks_is_refused_there_by_name(stride):
    with pytest.raises(ValueError, match=r"--policy stride has no llamacpp implementation; the llamacpp backend "
                                         r"supports full, .*zoomr \(use --backend torch for stride\)"):
        check_backend("stride", "llamacpp")


def test_an_eighth_policy_reaches_the_cli_options(stride):
    assert "stride" in knob_options()
    seen = {}
    app = typer.Typer()

    @app.command()
    @model_options()
    def run(opts: RunOptions):
        seen["opts"] = opts

    runner = CliRunner()
    assert "--stride" in runner.invoke(app, ["--help"], terminal_width=200).output
    r = runner.invoke(app, ["--policy", "stride", "--stride", "3", "--budget", "16", "--sink", "4"])
    assert r.exit_code == 0, r.output
    opts = seen["opts"]
    # typed, so given, though 4 is streaming's default (solve would refuse it for stride: not its knob)
    assert opts.policy == "stride" and opts.knobs == {"stride": 3, "budget": 16, "sink": 4}


def test_an_eighth_policy_is_built_by_the_factory_and_runs(stride):
    opts = RunOptions(policy="stride", knobs={"stride": 4, "budget": 6, "consensus": 1})
    assert policy_spec(opts) == PolicySpec("stride", 6, stride=4)   # zoomr's --consensus is not its knob
    factory = torch_cache_factory(opts)
    assert factory.policy_name == "stride(B=6, stride=4)"
    cache = PolicyKVCache(factory.spec.build(), 1, 2, 1, 4, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(0)
    for T in [10] + [1] * 10:
        cache.update(0, torch.randn(2, T, 4, generator=g), torch.randn(1, T, 4, generator=g),
                     torch.randn(1, T, 4, generator=g))
        cache.end_forward([0] * T, " ")
    # the last forward attended the selection made after position 18 (B = 6 newest, every 4th older) + 19
    assert cache.positions(0)[0].tolist() == [0, 4, 8, 12, 13, 14, 15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="--stride must be at least 1, got 0"):
        check_policy(replace(opts, knobs={"stride": 0}))


def test_an_eighth_policy_reaches_bench_planning_and_knob_checks(stride):
    assert plan_cells(["full", "stride", "zoomr"], [16, 32]) == [
        ("full", None), ("zoomr", None), ("stride", 16), ("stride", 32)]
    opts = RunOptions(knobs={"stride": 2})
    assert knob_scope(["full", "stride"], opts) == ["--stride 2 applies to stride only"]
    with pytest.raises(UserError, match="--stride is read by stride only, and none of --policies"):
        knob_scope(["full", "streaming"], opts)
    with pytest.raises(UserError, match="cell stride B=16: --stride must be at least 1"):
        validate_cells(plan_cells(["stride"], [16]), RunOptions(knobs={"stride": 0}))


def test_an_eighth_policy_is_a_rescue_base_on_torch_and_refused_by_llamacpp(stride):
    assert "stride" in evicting() and "stride" not in evicting("llamacpp")
    plan = plan_rescue(RescueOptions(rescue=True, base_policy="stride"), RunOptions(knobs={"stride": 3}))
    assert plan.base_opts.policy == "stride" and plan.helper_opts.knobs == {}
    refusal = (r"--policy stride has no llamacpp implementation; the llamacpp backend supports full, streaming, h2o, "
                r"snapkv, rkv, keydiff, triattention, sumr")
    with pytest.raises(ValueError, match=refusal):
        make_policy("stride", 256)
    with pytest.raises(UserError, match="--base-policy: " + refusal):
        plan_rescue(RescueOptions(rescue=True, base_policy="stride"), RunOptions(backend="llamacpp"))
    assert "| `stride` | the newest B + every stride-th older (test) | `--budget` 64 · `--stride` 8 (test) | yes |" \
        in policy_table_markdown()


# --- bench: every cell checked first, each policy reading its own knobs ------------------------------------------

def test_bench_checks_every_cell_before_any_runs():
    # B=64 cells come first and are fine; the streaming cell at B=8 cannot hold --window 16
    cells = plan_cells(["full", "streaming", "h2o", "rkv", "zoomr"], [64, 8])
    with pytest.raises(UserError, match=r"cell streaming B=8: streaming: --budget 8 is smaller than --sink 4 \+ "
                                        "--window 16"):
        validate_cells(cells, RunOptions(knobs={"window": 16}))
    # a rescue cell is checked at its own budget with the rescue base
    with pytest.raises(UserError, match="cell rescue B=8: rkv: --budget 8 must be larger than --window 8"):
        validate_cells([("rescue", 8)], RunOptions(), rescue_base="rkv")
    validate_cells(cells, RunOptions(knobs={"window": 4}))


def test_a_knob_applies_only_to_the_policies_that_have_it():
    opts = RunOptions(knobs={"sink": 2, "topk_per_head": 1, "window": 6})
    assert policy_spec(replace(opts, policy="streaming")).knobs == {"sink": 2, "window": 6}
    assert policy_spec(replace(opts, policy="zoomr")).knobs == {"topk_per_head": 1, "window": 6}
    assert policy_spec(replace(opts, policy="h2o")).knobs == {"window": 6}
    assert policy_spec(replace(opts, policy="full")).knobs == {}
    validate_cells(plan_cells(["full", "h2o", "zoomr", "streaming"], [16]), opts)
    assert knob_scope(["full", "h2o", "zoomr", "streaming"], opts) == [
        "--sink 2 applies to streaming only", "--topk-per-head 1 applies to zoomr only",
        "--window 6 applies to h2o, zoomr, streaming only"]
