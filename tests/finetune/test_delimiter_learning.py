"""The delimiter rows learn in a few CPU steps (issue 15): started from the embeddings of related text and
trained at their own --token-lr, the log-probability of <|begin_of_summary|> / <|end_of_summary|> where the
traces put them rises far above the mean-resized rows at the LoRA learning rate (which stay near -20 nats)."""

import json

import pytest

from zoomr.finetune.augment import augment_trace
from zoomr.finetune.data import encode_example
from zoomr.finetune.hf_model import (delimiter_ids, delimiter_init, load_weights, transformers_model,
                                     write_tokenizer)
from zoomr.finetune.train import TrainConfig, Trainer, delimiter_logprob, peft_model
from traces import TRACES

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tokenizer, weights, the 8 traces as examples with extractive summaries)."""
    out = tmp_path_factory.mktemp("tok")
    src, mcfg, tensors = load_weights(None)
    tok = write_tokenizer(src, out)
    rows = [augment_trace(k, q, a, lambda ps: [""] * len(ps)) for k, (q, a) in enumerate(TRACES)]
    examples = [encode_example(tok, r.problem, r.augmented, 160) for r in rows]
    return tok, mcfg, tensors, examples


def _train(setup, tmp_path, init: bool, token_lr: float):
    """Delimiter log-probs {id: nats} before and after STEPS steps."""
    import torch

    tok, mcfg, tensors, examples = setup
    ids = delimiter_ids(tok)
    cfg = TrainConfig(steps=STEPS, batch=4, seq_len=160, rank=4, alpha=8, warmup=1, token_lr=token_lr)
    model = peft_model(transformers_model(mcfg, tensors, tok.vocab_size, delimiter_init(tok) if init else None),
                       cfg, ids)
    pad = min(tok.eos_ids)
    trainer = Trainer(model, examples, cfg, pad, tmp_path / "ck", torch.device("cpu"))
    before = delimiter_logprob(model, examples, ids, pad, trainer.device)
    for _ in range(STEPS):
        trainer.train_step()
    return before, delimiter_logprob(model, examples, ids, pad, trainer.device)


def test_delimiters_become_likely_where_they_belong(setup, tmp_path):
    tok = setup[0]
    old_before, old_after = _train(setup, tmp_path / "old", init=False, token_lr=TrainConfig().lr)
    new_before, new_after = _train(setup, tmp_path / "new", init=True, token_lr=TrainConfig().token_lr)
    print(json.dumps({"old": [old_before, old_after], "new": [new_before, new_after]}))
    for t in delimiter_ids(tok):
        assert old_after[t] - old_before[t] < 2.0          # mean rows at the LoRA rate barely move
        assert new_before[t] > old_before[t] + 5.0          # related-text rows start far more likely
        assert new_after[t] > new_before[t] + 1.0           # and the own learning rate moves them further
        assert new_after[t] > old_after[t] + 8.0


def test_token_group_gets_its_own_rate_and_survives_resume(setup, tmp_path):
    """The delimiter rows sit in their own AdamW group at token_lr; a checkpoint restores both groups, with
    the scale of the resuming run's --token-lr."""
    import torch

    tok, mcfg, tensors, examples = setup
    ids = delimiter_ids(tok)
    cfg = TrainConfig(steps=1, batch=2, seq_len=96, rank=4, alpha=8, warmup=1, lr=1e-3, token_lr=2e-2)
    model = peft_model(transformers_model(mcfg, tensors, tok.vocab_size, delimiter_init(tok)), cfg, ids)
    trainer = Trainer(model, examples, cfg, min(tok.eos_ids), tmp_path / "ck", torch.device("cpu"))
    trainer.train_step()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([1e-3, 2e-2])
    trainer.save()
    again = Trainer(model, examples, TrainConfig(steps=2, batch=2, seq_len=96, rank=4, alpha=8, warmup=1, lr=1e-3,
                                                 token_lr=5e-3), min(tok.eos_ids), tmp_path / "ck",
                    torch.device("cpu"))
    assert again.resume() == 1
    assert [g["scale"] for g in again.optimizer.param_groups] == pytest.approx([1.0, 5.0])
    assert len(again.optimizer.state) == len(trainer.optimizer.state)
