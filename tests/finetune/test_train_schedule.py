"""Training schedule pieces that make --resume exact: batches as a function of the step, the learning rate."""

import pytest

from zoomr.errors import UserError
from zoomr.finetune.augment import Augmented
from zoomr.finetune.train import TrainConfig, batch_indices, learning_rate


def test_batches_cover_each_epoch_once_and_do_not_depend_on_history():
    n, b = 7, 3
    flat = [i for s in range(7) for i in batch_indices(s, n, b, seed=1)]  # 21 = three epochs of 7
    for e in range(3):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    assert batch_indices(5, n, b, seed=1) == flat[15:18]      # step 5 alone: what the loop took
    assert flat[:n] != [i for s in range(3) for i in batch_indices(s, n, b, seed=2)][:n]  # the seed matters


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup=10)
    lrs = [learning_rate(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4, rel=0.01)


@pytest.mark.parametrize("field, value, flag", [("steps", 0, "--steps"), ("seq_len", 8, "--seq-len"),
                                                ("lr", 2.0, "--lr"), ("checkpoint_every", 0, "--checkpoint-every")])
def test_bad_knobs_name_their_flag(field, value, flag):
    with pytest.raises(UserError, match=flag):
        TrainConfig(**{field: value}).validate()


def test_augmented_rows_are_checked():
    good = {"index": 0, "problem": "q", "paragraphs": ["p"], "summaries": ["s"], "augmented": "p\ns"}
    assert Augmented.from_json(good, "f").rejected == [None]
    for bad in ({**good, "augmented": " "}, {k: v for k, v in good.items() if k != "problem"}):
        with pytest.raises(UserError, match="augmented"):
            Augmented.from_json(bad, "f")


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    """Checkpoints hold the AdamW state as safetensors + JSON; loading it back gives the same state."""
    import torch

    from zoomr.finetune.train import load_optimizer_state, save_optimizer_state

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(3):
        (params[0].sum() + params[1].pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    save_optimizer_state(opt.state_dict(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.json", "optimizer.safetensors"]
    again = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=5.0)
    again.load_state_dict(load_optimizer_state(tmp_path, "cpu"))
    a, b = opt.state_dict(), again.state_dict()
    assert a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"] == 1e-3
    for pid, entry in a["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][pid][name])), (pid, name)
