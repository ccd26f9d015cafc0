"""zoomr finetune end to end on the embedded model: 2 LoRA steps on 8 hand-written traces, export, then the
exported directory runs in zoomr's own torch backend with the delimiters as single special tokens."""

import json
import math

import pytest

from zoomr.finetune.augment import augment_trace
from zoomr.finetune.pipeline import FinetuneConfig, run_finetune
from zoomr.finetune.train import TrainConfig, latest_checkpoint
from zoomr.kvstore.segments import BEGIN, END
from traces import TRACES

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def augmented(tmp_path_factory):
    """A pre-augmented file (extractive summaries: the summarizer's output is empty, so every summary is the
    fallback), so the test spends its time on training and export, not on generating summaries."""
    path = tmp_path_factory.mktemp("aug") / "augmented.jsonl"
    rows = [augment_trace(k, q, a, lambda ps: [""] * len(ps)) for k, (q, a) in enumerate(TRACES)]
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows))
    return path


def test_finetune_export_and_load(tmp_path, augmented):
    from zoomr.backends.generation import GenerationStats, generate
    from zoomr.backends.models import resolve_model
    from zoomr.backends.sampling import Sampler, SamplingParams
    from zoomr.backends.torch.engine import TorchBackend
    from zoomr.prompts import solve_prompt

    out = tmp_path / "ft"
    events = []
    cfg = FinetuneConfig(data=None, out=out, augmented=augmented, limit=8, device="cpu",
                         train=TrainConfig(steps=2, batch=2, seq_len=96, rank=4, alpha=8, checkpoint_every=1))
    summary = run_finetune(cfg, lambda kind, info: events.append((kind, info)))
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    assert all(math.isfinite(x) and 0 < x < 20 for x in summary["losses"])
    assert [i["step"] for k, i in events if k == "checkpoint"] == [1, 2]
    assert latest_checkpoint(out / "checkpoints").name == "step-000002"
    assert summary["counts"]["rejected"] == summary["counts"]["paragraphs"] > 0  # every summary was empty
    card = (out / "README.md").read_text()
    assert "loss.png" in card and (out / "loss.png").stat().st_size > 1000 and "--summaries model" in card

    backend = TorchBackend(resolve_model(str(out)), device="cpu", dtype="fp32", n_ctx=256)
    tok = backend.tokenizer
    begin, end = tok.control_tokens[BEGIN].id, tok.control_tokens[END].id
    assert {begin, end} == {49152, 49153} and tok.encode(f"x{BEGIN}y{END}") == tok.encode("x") + [begin] + \
        tok.encode("y") + [end]
    assert tok.encode(BEGIN, special=False) != [begin]  # user text still cannot write the delimiter
    stats = GenerationStats()
    seq = backend.new_sequence()
    ids = solve_prompt(tok, TRACES[0][0])
    toks = [t.token for t in generate(backend, seq, ids, Sampler(SamplingParams()), 4, stats)]
    assert len(toks) == 4 or stats.stop_reason == "eos"
    # the delimiter is a row of the exported vocabulary the decoder can read
    logits = backend.prefill(backend.new_sequence(), ids + [begin])
    assert logits.shape[-1] == 49154 and math.isfinite(float(logits.max()))
