"""zoomr finetune refuses bad input with one line and exit 2, before loading or writing anything."""

import json

import pytest

from conftest import assert_one_line_error, zoomr
from traces import write_traces


def run(tmp_path, *args):
    return zoomr("finetune", *args, "--steps", "1", "--no-live", timeout=120)


@pytest.mark.parametrize("content, msg", [(None, "no such file"), (b"", "no rows"), (b"hello\n", "not JSON"),
                                          (b'{"text": "x"}\n', "question\\+answer or problem\\+solution")])
@pytest.mark.slow
def test_bad_data(tmp_path, content, msg):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_bytes(content)
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"))
    assert_one_line_error(r)
    assert msg.replace("\\", "") in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_summarizer_that_cannot_load(tmp_path):
    data = write_traces(tmp_path / "data.jsonl", 2)
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"), "--summarizer", str(tmp_path / "none.gguf"))
    assert_one_line_error(r)
    assert "--summarizer" in r.stderr and "no such model file" in r.stderr


@pytest.mark.parametrize("flag", ["-m", "--summarizer"])
@pytest.mark.slow
def test_a_model_file_that_cannot_load_is_refused_before_out_is_written(tmp_path, flag):
    data = write_traces(tmp_path / "data.jsonl", 2)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOTAGGUF!")
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"), flag, str(fake))
    assert_one_line_error(r)
    assert f"zoomr: error: {flag}: {fake}: not a GGUF file (9 bytes)" in r.stderr
    assert not (tmp_path / "out").exists()   # so fixing the flag and running again needs no --force


@pytest.mark.parametrize("device, msg", [("tpu", "--device 'tpu' unknown"),
                                         ("cuda", "--device cuda requested but torch sees no CUDA device")])
@pytest.mark.slow
def test_a_device_that_cannot_train_is_refused_before_anything_runs(tmp_path, device, msg):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    data = write_traces(tmp_path / "data.jsonl", 2)
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"), "--device", device)
    assert_one_line_error(r)
    assert msg in r.stderr and not (tmp_path / "out").exists()


def test_architecture_zoomr_cannot_train(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    aug = tmp_path / "aug.jsonl"
    aug.write_text(json.dumps({"index": 0, "problem": "q", "paragraphs": ["p"], "summaries": ["s"],
                               "augmented": "p\n<|begin_of_summary|>s<|end_of_summary|>"}) + "\n")
    r = run(tmp_path, "--augmented", str(aug), "-m", str(model), "--out", str(tmp_path / "out"))
    assert_one_line_error(r)
    assert "unsupported model_type 'gpt2'" in r.stderr


@pytest.mark.slow
def test_existing_out_needs_resume_or_force(tmp_path):
    data = write_traces(tmp_path / "data.jsonl", 2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run(tmp_path, str(data), "--out", str(out))
    assert_one_line_error(r)
    assert "--resume" in r.stderr and "--force" in r.stderr
    r = run(tmp_path, str(data), "--out", str(out), "--force")  # not a finetune directory: never deleted
    assert_one_line_error(r)
    assert "not deleting" in r.stderr and (out / "keep.txt").read_text() == "mine"
    r = run(tmp_path, str(data), "--out", str(out), "--resume")
    assert_one_line_error(r)
    assert "nothing to resume" in r.stderr


def _model_with_delimiters(tmp_path, hf_tokenizer_dir, order, value=None):
    """A tiny random untied Llama HF directory whose tokenizer (the embedded model's, converted) already has
    the delimiters, appended in ``order``; ``value``: fill the delimiters' embedding and head rows with it."""
    import shutil

    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "model"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=49154, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    if value is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight[49152:] = value
            model.lm_head.weight[49152:] = value
    model.save_pretrained(d)
    tok = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in order])
    tok.save(str(d / "tokenizer.json"))
    shutil.copy(hf_tokenizer_dir / "tokenizer_config.json", d)
    return d


def _augmented(tmp_path):
    from zoomr.finetune.augment import augment_trace
    from traces import TRACES

    aug = tmp_path / "aug.jsonl"
    aug.write_text(json.dumps(augment_trace(0, *TRACES[0], lambda ps: [""] * len(ps)).to_json()) + "\n")
    return aug


def test_delimiters_at_other_ids_are_refused_before_out_is_written(tmp_path, hf_tokenizer_dir):
    from zoomr.kvstore.segments import BEGIN, END

    model = _model_with_delimiters(tmp_path, hf_tokenizer_dir, (END, BEGIN))   # end first: ids swapped
    r = run(tmp_path, "--augmented", str(_augmented(tmp_path)), "-m", str(model), "--out", str(tmp_path / "out"))
    assert_one_line_error(r)
    assert f"already has {BEGIN} as id 49153, but zoomr gives it id 49152" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_delimiters_at_zoomrs_ids_are_reused(tmp_path, hf_tokenizer_dir):
    """A model fine-tuned before: same ids in the exported tokenizer, and its delimiter rows are trained on,
    not started over from related text (one step at --token-lr 1e-2 moves an element by about 0.01)."""
    import numpy as np
    from safetensors.numpy import load_file

    from zoomr.backends.tokenizer import HFTokenizer
    from zoomr.kvstore.segments import BEGIN, END

    model = _model_with_delimiters(tmp_path, hf_tokenizer_dir, (BEGIN, END), value=0.5)
    out = tmp_path / "out"
    r = run(tmp_path, "--augmented", str(_augmented(tmp_path)), "-m", str(model), "--out", str(out),
            "--seq-len", "512", "--rank", "4", "--batch", "1", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    tok = HFTokenizer(out)
    assert [tok.control_tokens[d].id for d in (BEGIN, END)] == [49152, 49153] and tok.vocab_size == 49154
    w = load_file(str(out / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert w[name].shape[0] == 49154
        assert np.abs(w[name][49152:] - 0.5).max() < 0.05
