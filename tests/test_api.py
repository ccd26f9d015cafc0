"""The public API (``import zoomr``): every exported name resolves, solve on the real model, the solve prompt,
and the errors load/make_policy give before any model loads."""

import dataclasses

import pytest

import zoomr
from zoomr.backends.chat_template import encode_rendered
from zoomr.kvstore.h2o import H2OPolicy


def test_every_exported_name_resolves():
    for name in zoomr.__all__:
        assert getattr(zoomr, name) is not None, name
    assert set(zoomr.__all__) <= set(dir(zoomr))
    with pytest.raises(AttributeError):
        zoomr.no_such_name


def test_solve_streams_and_accounts_its_tokens(torch_backend):
    deltas = []
    r = zoomr.solve(torch_backend, "What is 2 + 3?", n_predict=8, on_token=deltas.append)
    assert "".join(deltas) == r.text and len(r.token_ids) == len(deltas) <= 8
    assert r.stop_reason in ("eos", "length")
    prompt = zoomr.solve_prompt(torch_backend.tokenizer, "What is 2 + 3?")
    rec = r.record()
    assert rec["prompt_tokens"] == len(prompt) and rec["tokens_generated"] == len(r.token_ids)
    assert rec["kv"]["full_tokens"] == len(prompt) + len(r.token_ids)
    assert rec["sampling"] == dataclasses.asdict(zoomr.SamplingParams()) and rec["sampling"]["temperature"] == 0
    # greedy: the same problem gives the same tokens again (the first run's sequence was freed, not reused)
    assert zoomr.solve(torch_backend, "What is 2 + 3?", n_predict=8).token_ids == r.token_ids


def test_a_prompt_longer_than_the_context_is_refused_before_generating(torch_backend):
    with pytest.raises(zoomr.UserError, match=f"more than -c {torch_backend.n_ctx}"):
        zoomr.solve(torch_backend, "two " * torch_backend.n_ctx)


def test_solve_prompt_applies_the_chat_template(torch_backend):
    """The trap the rename closes: encode_rendered on a raw problem sends it without the chat format."""
    tok = torch_backend.tokenizer
    text = tok.decode(zoomr.solve_prompt(tok, "What is 2 + 3?", system="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "What is 2 + 3?" in text and "\\boxed{}" in text and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>" not in tok.decode(encode_rendered(tok, "What is 2 + 3?"))


def test_solve_asks_for_summaries_as_the_cli_does(torch_backend):
    """``summaries="prompted"`` under sumr/zoomr: zoomr.solve appends the summary instruction to the system
    message itself (zoomr.solving.solve_ids, the function the CLI's solve and rescue go through)."""
    from zoomr.kvstore.registry import PolicyCacheFactory, PolicySpec
    from zoomr.prompts import system_with_summaries
    from zoomr.solving import solve_ids

    tok, problem = torch_backend.tokenizer, "What is 2 + 3?"
    for policy in ("zoomr", "sumr"):
        backend = torch_backend.with_cache_factory(PolicyCacheFactory(PolicySpec(policy, window=16,
                                                                                 summaries="prompted")))
        asked = zoomr.solve_prompt(tok, problem, system_with_summaries("Be brief.", policy, "prompted"))
        assert solve_ids(backend, problem, "Be brief.") == asked != zoomr.solve_prompt(tok, problem, "Be brief.")
        assert zoomr.solve(backend, problem, system="Be brief.", n_predict=1).record()["prompt_tokens"] == len(asked)
    # the policy's own default (auto), full KV, and a cache factory with no spec: the system message as given
    auto = torch_backend.with_cache_factory(PolicyCacheFactory(PolicySpec("zoomr", window=16)))
    custom = torch_backend.with_cache_factory(lambda backend: PolicyCacheFactory(PolicySpec("zoomr", window=16,
                                                                                       summaries="prompted"))(backend))
    for backend in (auto, torch_backend, custom):
        assert solve_ids(backend, problem) == zoomr.solve_prompt(tok, problem)


@pytest.mark.slow
def test_library_solve_and_the_cli_send_the_same_prompt():
    """``zoomr solve --policy sumr --summaries prompted`` and zoomr.solve on the model zoomr.load builds with
    the same flags: the same prompt, hence (greedy) the same text, on both backends."""
    import json

    from conftest import zoomr as run_zoomr

    problem, knobs = "What is 2 + 3?", {"policy": "sumr", "summaries": "prompted", "window": 16}
    for backend in ("torch", "llamacpp"):
        r = run_zoomr("solve", "-p", problem, "--system", "Be brief.", "--backend", backend, "--policy", "sumr",
                      "--summaries", "prompted", "--window", "16", "-n", "8", "-t", "1", "--no-live", "--json", "-")
        assert r.returncode == 0, r.stderr
        cli = json.loads(r.stdout)
        model = zoomr.load(backend=backend, threads=1, **knobs)
        lib = zoomr.solve(model, problem, system="Be brief.", n_predict=8).record()
        assert (lib["prompt_tokens"], lib["text"], lib["model"]) == (cli["prompt_tokens"], cli["text"], cli["model"])
        plain = zoomr.solve_prompt(model.tokenizer, problem, "Be brief.")
        assert lib["prompt_tokens"] > len(plain)   # the instruction was added


def test_load_refuses_bad_options_before_loading_a_model():
    with pytest.raises(TypeError, match="temp"):
        zoomr.load(temp=0.7)
    with pytest.raises(TypeError, match="frobnicate"):
        zoomr.load(frobnicate=1)
    with pytest.raises(zoomr.UserError, match="--policy 'nope' unknown"):
        zoomr.load(policy="nope")
    with pytest.raises(ValueError, match="h2o"):
        zoomr.load(policy="h2o", budget=1)


def test_make_policy_builds_a_fresh_policy_with_its_knobs():
    p = zoomr.make_policy("h2o", budget=8)
    assert isinstance(p, H2OPolicy) and p.budget == 8 and p is not zoomr.make_policy("h2o", budget=8)
    assert set(zoomr.POLICIES) >= {"full", "h2o", "rkv", "zoomr"}
    with pytest.raises(ValueError, match="unknown"):
        zoomr.make_policy("nope")
    with pytest.raises(TypeError):
        zoomr.make_policy("h2o", frobnicate=1)


def test_readme_python_section_and_library_page_use_only_exported_names():
    """README's "Using zoomr from Python" snippet and docs/library.md name only exported names, and together
    (the snippet, the page, the page's list of the rest) they name every one."""
    import re

    from conftest import ROOT

    section = (ROOT / "README.md").read_text().split("## Using zoomr from Python", 1)[1].split("\n## ", 1)[0]
    page = (ROOT / "docs" / "library.md").read_text()
    # top-level names only: a dotted module path (zoomr.backends.sampling.sample_batch) is a submodule's API
    used = set(re.findall(r"\bzoomr\.(\w+)\b(?!\.)", section + page)) - {"__all__"}
    assert used and used <= set(zoomr.__all__), used - set(zoomr.__all__)
    listed = set(re.findall(r"`(\w+)`", page.split("`zoomr.__all__` lists the rest:", 1)[1]))
    assert listed | used == set(zoomr.__all__), set(zoomr.__all__) ^ (listed | used)
