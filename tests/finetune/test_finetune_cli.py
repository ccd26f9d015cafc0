"""zoomr finetune refuses bad input with one line and exit 2, before loading or writing anything."""

import json

import pytest

from conftest import assert_one_line_error, zoomr
from traces import write_traces


def run(tmp_path, *args):
    return zoomr("finetune", *args, "--steps", "1", "--no-live", timeout=120)


@pytest.mark.parametrize("content, msg", [(None, "no such file"), (b"", "no rows"), (b"hello\n", "not JSON"),
                                          (b'{"text": "x"}\n', "question\\+answer or problem\\+solution")])
def test_bad_data(tmp_path, content, msg):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_bytes(content)
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"))
    assert_one_line_error(r)
    assert msg.replace("\\", "") in r.stderr and not (tmp_path / "out").exists()


def test_summarizer_that_cannot_load(tmp_path):
    data = write_traces(tmp_path / "data.jsonl", 2)
    r = run(tmp_path, str(data), "--out", str(tmp_path / "out"), "--summarizer", str(tmp_path / "none.gguf"))
    assert_one_line_error(r)
    assert "--summarizer" in r.stderr and "no such model file" in r.stderr


@pytest.mark.parametrize("flag", ["-m", "--summarizer"])
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
