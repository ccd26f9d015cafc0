"""``--compile``: decode steps through ``torch.compile`` follow the eager ones, fall back when compiling fails,
and refuse what cannot work with one error line."""

import os
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import ENV, ROOT, assert_one_line_error, zoomr, zoomr_cmd
from zoomr.backends.torch.model import _CompiledOrEager


def greedy(be, ids: list[list[int]], steps: int) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens of each prompt decoded together (one batch), and the stacked [steps, B, vocab] logits."""
    seqs = [be.new_sequence() for _ in ids]
    logits = be.forward_batch(seqs, ids).float().cpu().numpy()
    toks, rows = [[] for _ in ids], []
    for _ in range(steps):
        nxt = [int(x) for x in logits.argmax(-1)]
        for out, t in zip(toks, nxt):
            out.append(t)
        logits = be.forward_batch(seqs, [[t] for t in nxt]).float().cpu().numpy()
        rows.append(logits)
    return toks, np.stack(rows)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor builds C++ kernels on a CPU: no compiler here (refusal tested below)")
@pytest.mark.parametrize("policy", ["full", "zoomr"])
def test_compiled_decode_follows_eager(policy):
    import zoomr as api
    from torch._dynamo.utils import counters

    prompts = [list(range(200, 290)), list(range(900, 960))]   # ragged: two lengths in one batch
    knobs = {"window": 32} if policy == "zoomr" else {}   # a short window: ZoomR selects within 24 steps
    # --quant int4 on both: --compile compiles torch's layer math, which --quant auto may hand to ggml instead
    eager = api.load(policy=policy, ctx_size=512, quant="int4", **knobs)
    graphs = counters["stats"]["unique_graphs"]
    compiled = api.load(policy=policy, ctx_size=512, compile=True, quant="int4", **knobs)
    assert "compiled decode" in compiled.describe() and "compiled" not in eager.describe()
    if policy == "full":   # the first load compiles (later ones reuse the graphs of this process)
        assert counters["stats"]["unique_graphs"] >= graphs + 2
    t_eager, l_eager = greedy(eager, prompts, 24)
    t_comp, l_comp = greedy(compiled, prompts, 24)
    assert t_comp == t_eager
    # bf16 linears: fused kernels round differently, so logits agree to bf16's resolution, not bit for bit
    for step in range(l_eager.shape[0]):
        for b in range(len(prompts)):
            top = np.argsort(-l_eager[step, b])[:20]
            assert np.abs(l_eager[step, b, top] - l_comp[step, b, top]).max() < 0.3


def no_working_compiler():
    """inductor set to a C++ compiler that does not exist, with no cached kernel to stand in for it (torch's own
    ``config.patch``: pytest's monkeypatch would delete, not restore, the settings of torch's config module)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"fx_graph_cache": False, "cpp.cxx": (os.path.join(ROOT, "no-such-compiler++"),)})


def test_failed_compile_falls_back_to_eager(capsys):
    torch._dynamo.reset()

    def scaled_tanh(x):
        return torch.tanh(x * 3.0) + 1.0

    def shifted_sin(x):
        return torch.sin(x - 0.5) * 2.0

    state = {"failed": False}
    f, g = _CompiledOrEager(scaled_tanh, state), _CompiledOrEager(shifted_sin, state)
    x = torch.linspace(-1, 1, 11)
    with no_working_compiler():
        torch.testing.assert_close(f(x), scaled_tanh(x))
        assert state["failed"]                   # later calls, of either function, skip the compiler
        torch.testing.assert_close(g(x), shifted_sin(x))
        torch.testing.assert_close(f(x * 2), scaled_tanh(x * 2))
    err = capsys.readouterr().err
    assert err.count("zoomr: warning: --compile failed") == 1 and "decoding eagerly" in err
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_refused_on_llamacpp():
    r = zoomr("solve", "--compile", "--backend", "llamacpp", "examples/problem.txt")
    assert_one_line_error(r)
    assert "--compile applies to the torch backend" in r.stderr


@pytest.mark.slow
def test_compile_without_a_cxx_compiler_is_one_line(tmp_path):
    import subprocess

    bare = tmp_path / "bin"   # a PATH holding only this interpreter: no g++, clang++ or c++
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")
    env = {**ENV, "PATH": str(bare)}
    env.pop("CXX", None)
    r = subprocess.run(zoomr_cmd() + ["solve", "--compile", "-n", "4", "examples/problem.txt"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert_one_line_error(r)
    assert "needs a C++ compiler" in r.stderr


@pytest.mark.slow
def test_a_model_whose_compile_fails_decodes_eagerly_and_says_so(capsys):
    import zoomr as api

    torch._dynamo.reset()
    with no_working_compiler():
        be = api.load(compile=True, ctx_size=128)      # compiles at load: fails there, once
    assert not be.model.compiled and "compiled" not in be.describe()
    assert capsys.readouterr().err.count("zoomr: warning: --compile failed") == 1
    seq = be.new_sequence()
    be.prefill(seq, [1, 2, 3])
    assert np.isfinite(be.decode(seq, 4)).all()
    assert capsys.readouterr().err == ""
    torch._dynamo.reset()
