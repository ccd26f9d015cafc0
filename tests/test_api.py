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


def test_readme_python_section_uses_only_exported_names():
    import re

    from conftest import ROOT

    section = (ROOT / "README.md").read_text().split("## Using zoomr from Python", 1)[1].split("\n## ", 1)[0]
    # top-level names only: a dotted module path (zoomr.backends.sampling.sample_batch) is a submodule's API
    used = set(re.findall(r"\bzoomr\.(\w+)\b(?!\.)", section)) - {"__all__"}
    assert used and used <= set(zoomr.__all__), used - set(zoomr.__all__)
    listed = set(re.findall(r"`(\w+)`", section.split("`zoomr.__all__` lists the rest:", 1)[1]))
    assert listed | used == set(zoomr.__all__), set(zoomr.__all__) ^ (listed | used)
