"""Ctrl-C during training saves a checkpoint; --resume continues from it; a checkpoint that cannot be
written (the file-size limit standing in for a full disk) is one line, exit 2, the previous one intact."""

import json
import resource
import signal
import subprocess

import pytest

from conftest import ENV, ROOT, assert_one_line_error, sigint_default, wait_for, zoomr_cmd
from traces import write_traces

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ARGS = ["--limit", "4", "--batch", "1", "--seq-len", "128", "--rank", "4", "--alpha", "8", "--device", "cpu",
        "--summary-tokens", "4", "--no-live"]
# above tokenizer.json (3.5 MB), below a rank-4 adapter of the embedded model (4.8 MB)
FILE_LIMIT = 4_000_000


def small_files() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_checkpoints_then_a_full_disk_keeps_it(tmp_path, stop):
    from safetensors.torch import load_file

    from zoomr.finetune.train import latest_checkpoint

    data, out, err = write_traces(tmp_path / "data.jsonl"), tmp_path / "out", tmp_path / "err.txt"
    with open(err, "w") as f:
        p = subprocess.Popen(zoomr_cmd() + ["finetune", str(data), "--out", str(out), "--steps", "1000",
                                            "--checkpoint-every", "1000"] + ARGS,
                             stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT, env=ENV, preexec_fn=sigint_default)
        wait_for(lambda: "step 2/1000" in err.read_text(), p, 300, "two training steps")
        p.send_signal(stop)
        assert p.wait(timeout=120) == 130, err.read_text()
    ck = latest_checkpoint(out / "checkpoints")
    assert ck is not None and json.loads((ck / "state.json").read_text())["step"] >= 2
    done = json.loads((ck / "state.json").read_text())["step"]
    if stop == signal.SIGTERM:  # the full-disk half below is the same whichever signal stopped the run
        assert "interrupted" in err.read_text() and "Traceback" not in err.read_text()
        return

    r = subprocess.run(zoomr_cmd() + ["finetune", str(data), "--out", str(out), "--steps", str(done + 1),
                                      "--resume"] + ARGS, capture_output=True, text=True, cwd=ROOT, env=ENV,
                       timeout=300, preexec_fn=small_files)
    assert_one_line_error(r)
    assert f"resumed at step {done}" in r.stderr
    assert f"checkpoint of step {done + 1}" in r.stderr and f"the last checkpoint ({ck.name}) is intact" in r.stderr
    assert latest_checkpoint(out / "checkpoints") == ck and not list((out / "checkpoints").glob(".tmp-*"))
    assert load_file(str(ck / "adapter.safetensors"))  # still loadable
