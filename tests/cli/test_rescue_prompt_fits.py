"""KV-Rescue checks its prompt as plain solve does (zoomr.solving.fit_prompt): an over-long problem or text
that is not valid Unicode is the same one line, exit 2, before the helper and scorer load."""

import pytest

import zoomr
from conftest import assert_one_line_error, zoomr as run_zoomr


@pytest.mark.slow
def test_over_long_problem_with_rescue_is_plain_solves_error(tmp_path):
    problem = tmp_path / "long.txt"
    problem.write_text("word " * 200)
    plain = run_zoomr("solve", "-c", "64", str(problem), "--no-live")
    rescue = run_zoomr("solve", "-c", "64", "--rescue", str(problem), "--no-live")
    assert_one_line_error(plain)
    assert_one_line_error(rescue)
    line = rescue.stderr.strip().splitlines()[-1]
    assert line == plain.stderr.strip().splitlines()[-1]
    assert line.startswith("zoomr: error: the prompt has ") and line.endswith("tokens, more than -c 64 allows")
    # refused once the base's tokenizer could count it, before the other two models load
    assert "loading helper model" not in rescue.stderr and "loading scorer" not in rescue.stderr


def test_library_rescue_checks_the_prompt_like_solve(torch_backend):
    long = "two " * torch_backend.n_ctx
    with pytest.raises(zoomr.UserError) as solve_err:
        zoomr.solve(torch_backend, long)
    with pytest.raises(zoomr.UserError) as rescue_err:
        zoomr.run_rescue(torch_backend, long)
    assert str(rescue_err.value) == str(solve_err.value)
    with pytest.raises(zoomr.UserError, match="the problem: contains an unpaired surrogate"):
        zoomr.run_rescue(torch_backend, "What is 1 + \ud800?")
