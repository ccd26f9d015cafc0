"""LoRA fine-tuning with checkpoints (ZoomR §3.2: "We then fine-tune a base reasoning model with LoRA").

LoRA adapters (peft) on every attention and MLP projection; the two delimiter rows of the embedding and of
the LM head (one shared matrix when tied, two when untied) are trained too, through peft's
``trainable_token_indices``, since the base model has never seen those tokens. Batches are a pure function
of (step, seed), and dropout is seeded per step, so a run resumed from a checkpoint takes the same batches
as one that never stopped.

A checkpoint (``checkpoints/step-NNNNNN/``: adapter + trainable-token weights as safetensors, optimizer
state as safetensors + JSON (no pickle anywhere), ``state.json`` with the step and the losses so far) is written into a temporary directory and
renamed into place, then ``checkpoints/latest`` is replaced: a write that fails (disk full) leaves the
previous checkpoint as it was.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from zoomr.errors import UserError

from .data import Example, collate

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FULL_DISK = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
KEEP_CHECKPOINTS = 2
# AdamW moves each element by about lr per step whatever its gradient's size, so at the LoRA rate (2e-4) a
# new delimiter row (SmolLM2-135M's embedding elements: mean |x| 0.10) needs hundreds of steps to move by
# its own scale. Measured on the embedded model (tests/finetune/test_delimiter_learning.py, 8 traces,
# batch 4, 3 steps): mean log p of the delimiters where they belong, begin / end, went -20.2 / -20.0 →
# -19.8 / -19.7 with mean-resized rows at 2e-4, and -6.2 / -6.8 (related-text rows) → -0.04 / -0.80 at
# 1e-2 (50 × the LoRA lr): within a few steps, while the loss still penalizes the delimiter elsewhere.
TOKEN_LR = 1e-2


@dataclass(frozen=True)
class TrainConfig:
    """LoRA knobs (the CLI's flags of the same names).

    Attributes:
        steps: optimizer steps; batch: examples per step; seq_len: most tokens per example (tokens);
        rank, alpha, dropout: LoRA (Hu et al. 2021); lr: peak learning rate of AdamW, reached after
        ``warmup`` steps (linear), then cosine-decayed to 10 % at ``steps``; token_lr: the same for the
        delimiter rows (their own parameter group, same schedule scaled by token_lr / lr); checkpoint_every: steps between
        checkpoints (the last step always gets one); seed: batch order and dropout.

    The paper's own values (its Table 2) are not in the text available here; these defaults are the usual
    LoRA ones (r 16, α 32, lr 2e-4) and sized for small models on a CPU. seq_len 384: GSM8K train traces
    augmented with summaries, as the solve prompt + assistant turn, measured 145..512 tokens (median 240)
    on the first 32; 384 holds 29 of them whole, and a batch pads to its longest, so 512 mostly paid for padding.
    """

    steps: int = 200
    batch: int = 4
    seq_len: int = 384
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    lr: float = 2e-4
    token_lr: float = TOKEN_LR
    warmup: int = 10
    checkpoint_every: int = 50
    seed: int = 0

    def validate(self) -> "TrainConfig":
        """Raises: UserError: a knob out of range (named by its flag)."""
        for name in ("steps", "batch", "seq_len", "rank", "alpha", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 16:
            raise UserError(f"--seq-len must be >= 16 tokens, got {self.seq_len}")
        if not (0 < self.lr < 1):
            raise UserError(f"--lr must be in (0, 1), got {self.lr}")
        if not (0 < self.token_lr < 1):
            raise UserError(f"--token-lr must be in (0, 1), got {self.token_lr}")
        return self


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Learning rate of 0-based ``step``: linear warmup over ``cfg.warmup`` steps, then cosine to 0.1 × lr."""
    warm = min(cfg.warmup, max(1, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batch_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Example indices of 0-based ``step``: epochs of a seeded permutation of the n examples, read in order."""
    import numpy as np

    out = []
    for i in range(step * batch, (step + 1) * batch):
        epoch, at = divmod(i, n)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[at]))
    return out


class CheckpointError(UserError):
    """A checkpoint could not be written (disk full); the previous one is intact."""


def disk_full(e: BaseException) -> bool:
    """True when ``e`` is a write that failed for want of space: ENOSPC, EFBIG (a file-size limit) or
    EDQUOT, as an OSError or as safetensors' own error, which carries only the message (``os error 28``)."""
    if isinstance(e, OSError):
        return e.errno in _FULL_DISK
    return any(f"os error {n})" in str(e) for n in _FULL_DISK)


def token_modules(model, token_ids: list[int]) -> dict[str, list[int]]:
    """peft's ``trainable_token_indices`` for ``model``: the ``token_ids`` rows of the input embedding and of
    the LM head, under their module names ({"embed_tokens": ids, "lm_head": ids} for Llama/Qwen2).

    Both are named for every model. An untied head needs its own rows trained: a new token's head row is
    what makes the model predict it, and LoRA adapts no head. For a tied model peft sees the head share the
    embedding's weight with the same ids, wraps the embedding only and ties the head to that wrapper (peft
    ``utils/other.py``, ``_set_trainable`` with ``tied_adapter``), so one delta serves both.
    """
    names = {id(m): n for n, m in model.named_modules()}
    mods = [model.get_input_embeddings(), model.get_output_embeddings()]
    return {names[id(m)].rsplit(".", 1)[-1]: list(token_ids) for m in mods if m is not None}


def peft_model(model, cfg: TrainConfig, token_ids: list[int]):
    """``model`` wrapped with LoRA adapters and the ``token_ids`` rows of its embedding and LM head trainable
    (:func:`token_modules`).

    Raises:
        UserError: peft (the ``finetune`` extra) is missing or cannot adapt this model.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("zoomr finetune needs the finetune extra: pip install 'zoomr[finetune]'") from None
    conf = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(LORA_TARGETS),
                      trainable_token_indices=token_modules(model, token_ids), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, conf)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"peft cannot add LoRA adapters to this model ({e})") from None


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or None when there is none yet."""
    f = ckpt_dir / "latest"
    if not f.is_file():
        return None
    p = ckpt_dir / f.read_text().strip()
    return p if (p / "state.json").is_file() else None


class Trainer:
    """The training loop over tokenized examples, resumable from ``ckpt_dir``.

    Args:
        model: a peft model (:func:`peft_model`); examples: at least one; pad_id: the padding token id;
        ckpt_dir: where checkpoints go; device: a torch device.
    Attributes:
        step: steps done; losses: mean token loss (nats) of each step done.
    """

    def __init__(self, model, examples: list[Example], cfg: TrainConfig, pad_id: int, ckpt_dir: Path, device):
        import torch

        self.model, self.examples, self.cfg, self.pad_id = model, examples, cfg, pad_id
        self.ckpt_dir, self.device = ckpt_dir, device
        self.model.to(device)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        tokens = [p for n, p in named if "trainable_tokens" in n]
        lora = [p for n, p in named if "trainable_tokens" not in n]
        # the group's "scale" (its lr / the LoRA lr) travels in the checkpoint's optimizer.json
        groups = [{"params": lora, "scale": 1.0}] + ([{"params": tokens, "scale": cfg.token_lr / cfg.lr}] if tokens else [])
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
        self._scales = [g["scale"] for g in groups]
        self.step = 0
        self.losses: list[float] = []

    def resume(self) -> int:
        """Load the latest checkpoint, if any; returns the step it was saved at (0 when none).

        Raises:
            UserError: the checkpoint's files are unreadable or were made with other LoRA knobs.
        """
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        ck = latest_checkpoint(self.ckpt_dir)
        if ck is None:
            return 0
        try:
            state = json.loads((ck / "state.json").read_text())
            set_peft_model_state_dict(self.model, load_file(str(ck / "adapter.safetensors"), device=str(self.device)))
            self.optimizer.load_state_dict(load_optimizer_state(ck, self.device))
            for group, scale in zip(self.optimizer.param_groups, self._scales):
                group["scale"] = scale  # the --token-lr of this run, not of the one that saved
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise UserError(f"{ck}: cannot resume from this checkpoint ({type(e).__name__}: {e})") from None
        self.step, self.losses = int(state["step"]), [float(x) for x in state["losses"]]
        return self.step

    def save(self) -> Path:
        """Write the checkpoint of the current step (atomically; see the module docstring).

        Raises:
            CheckpointError: the disk (or the file-size limit) is full; the previous checkpoint is intact.
        """
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        name = f"step-{self.step:06d}"
        tmp = self.ckpt_dir / f".tmp-{name}"
        final = self.ckpt_dir / name
        try:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            sd = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(self.model).items()}
            save_file(sd, str(tmp / "adapter.safetensors"))
            save_optimizer_state(self.optimizer.state_dict(), tmp)
            (tmp / "state.json").write_text(json.dumps({"step": self.step, "losses": self.losses,
                                                        "config": asdict(self.cfg)}))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer = self.ckpt_dir / ".latest.tmp"
            pointer.write_text(name)
            os.replace(pointer, self.ckpt_dir / "latest")
        except Exception as e:  # safetensors and torch raise their own errors for a failed write
            shutil.rmtree(tmp, ignore_errors=True)
            if not disk_full(e):
                raise
            prev = latest_checkpoint(self.ckpt_dir)
            kept = f"the last checkpoint ({prev.name}) is intact" if prev else "no earlier checkpoint exists"
            raise CheckpointError(f"cannot write the checkpoint of step {self.step} in {self.ckpt_dir}: no space "
                                  f"({e}); {kept}; free space, then --resume") from None
        for old in sorted(self.ckpt_dir.glob("step-*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def train_step(self) -> float:
        """One optimizer step on the batch of :attr:`step`; returns its mean token loss (nats)."""
        import torch

        cfg = self.cfg
        torch.manual_seed(cfg.seed * 1_000_003 + self.step)
        batch = [self.examples[i] for i in batch_indices(self.step, len(self.examples), cfg.batch, cfg.seed)]
        ids, mask, labels = (t.to(self.device) for t in collate(batch, self.pad_id))
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(cfg, self.step) * group["scale"]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.losses.append(float(loss.detach()))
        return self.losses[-1]

    def run(self, on_step: Callable[[int, float], None] | None = None,
            on_checkpoint: Callable[[int], None] | None = None) -> None:
        """Train until ``cfg.steps``, checkpointing every ``checkpoint_every`` steps and at the end.

        Ctrl-C (KeyboardInterrupt) saves a checkpoint of the steps done, then propagates.

        Raises:
            CheckpointError: see :meth:`save`. KeyboardInterrupt: after saving.
        """
        saved = self.step
        try:
            while self.step < self.cfg.steps:
                loss = self.train_step()
                if on_step is not None:
                    on_step(self.step, loss)
                if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self.save()
                    saved = self.step
                    if on_checkpoint is not None:
                        on_checkpoint(self.step)
        except KeyboardInterrupt:
            if self.step > saved:
                self.save()
                if on_checkpoint is not None:
                    on_checkpoint(self.step)
            raise


def save_optimizer_state(state: dict, ck: Path) -> None:
    """Write an optimizer's ``state_dict()`` without pickle: its tensors to ``optimizer.safetensors`` (keyed
    ``<param id>.<name>``), everything else (param groups, non-tensor state) to ``optimizer.json``.

    Raises:
        OSError: the files cannot be written.
    """
    import torch
    from safetensors.torch import save_file

    tensors, plain = {}, {}
    for pid, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{name}"] = value.detach().contiguous().cpu()
            else:
                plain[f"{pid}.{name}"] = value
    save_file(tensors, str(ck / "optimizer.safetensors"))
    (ck / "optimizer.json").write_text(json.dumps({"param_groups": state["param_groups"], "plain": plain}))


def load_optimizer_state(ck: Path, device) -> dict:
    """The ``state_dict()`` :func:`save_optimizer_state` wrote, tensors on ``device``.

    Raises:
        OSError, ValueError, KeyError: missing or malformed files.
    """
    from safetensors.torch import load_file

    meta = json.loads((ck / "optimizer.json").read_text())
    state: dict = {}
    for key, value in [*load_file(str(ck / "optimizer.safetensors"), device=str(device)).items(),
                       *meta["plain"].items()]:
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def delimiter_logprob(model, examples: list[Example], token_ids: list[int], pad_id: int, device) -> dict[int, float]:
    """Mean log-probability (nats) the model gives each of ``token_ids`` at the positions where the examples'
    labels hold it (teacher forcing, eval mode, no gradient): {token id: mean log p}; ids never in a label
    are left out. The measure of whether the delimiters are learnt: free generation writes a summary only
    once this is near 0 where a paragraph ends.

    Args:
        model: the (peft-wrapped) causal LM; examples: encoded examples, run 4 at a time ([4, T] ids,
            T the longest of each group); token_ids: the ids to measure (the delimiters); pad_id: padding id;
        device: where the model runs.
    """
    import torch

    was_training = model.training
    model.eval()
    sums = {t: [0.0, 0] for t in token_ids}
    with torch.no_grad():
        for k in range(0, len(examples), 4):
            ids, mask, labels = (t.to(device) for t in collate(examples[k:k + 4], pad_id))
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
            target = labels[:, 1:]
            for t in token_ids:
                where = target == t
                if where.any():
                    sums[t][0] += float(logp[..., t][where].sum())
                    sums[t][1] += int(where.sum())
    model.train(was_training)  # a measurement: the model is left in the mode it came in
    return {t: s / n for t, (s, n) in sums.items() if n}
