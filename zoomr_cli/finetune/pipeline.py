"""``zoomr finetune``'s stages in order, each resumable: augment → tokenize → train → export.

The output directory holds everything: ``finetune.json`` (the run's settings, checked on ``--resume``),
``augmented.jsonl`` (appended and fsynced per trace, so a resumed run summarizes only what is missing),
``checkpoints/``, then the exported HF model (``config.json``, ``model.safetensors``, tokenizer files),
``loss.png`` and ``README.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zoomr.backends.models import resolve_model
from zoomr.errors import UserError

from .augment import DEFAULT_PARAGRAPH_TOKENS, Augmented, augment_trace, read_jsonl, read_traces, rejection_counts
from .summarizer import DEFAULT_SUMMARY_TOKENS
from .train import TrainConfig

RUN_FILE = "finetune.json"
AUGMENTED = "augmented.jsonl"
# settings that must not change between a run and its --resume (the rest may: --steps can grow)
_FIXED = ("data", "augmented", "model", "summarizer", "limit", "summary_tokens", "paragraph_tokens", "seq_len", "rank",
          "alpha", "batch", "seed")


@dataclass
class FinetuneConfig:
    """Everything a finetune run needs (the CLI's flags).

    Attributes:
        data: trace JSONL (None when ``augmented`` is given); out: output directory; model: ``-m`` of the
        model to fine-tune (None: embedded); summarizer: ``-m`` of the summarizer (None: embedded);
        augmented: an ``augmented.jsonl`` to train on instead of augmenting ``data``; limit: first N traces;
        summary_tokens, paragraph_tokens: augmentation lengths (tokens); train: LoRA knobs; resume, force:
        what to do with an existing ``out``; device: torch device for training; command: the command line,
        for the model card.
    """

    data: Path | None
    out: Path
    model: str | None = None
    summarizer: str | None = None
    augmented: Path | None = None
    limit: int | None = None
    summary_tokens: int = DEFAULT_SUMMARY_TOKENS
    paragraph_tokens: int = DEFAULT_PARAGRAPH_TOKENS
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: bool = False
    force: bool = False
    device: str = "auto"
    command: str = "zoomr finetune"

    def settings(self) -> dict:
        """The JSON-able settings recorded in ``finetune.json``."""
        return {"data": str(self.data) if self.data else None, "augmented": str(self.augmented) if self.augmented else None,
                "model": self.model, "summarizer": self.summarizer, "limit": self.limit,
                "summary_tokens": self.summary_tokens, "paragraph_tokens": self.paragraph_tokens, **asdict(self.train)}


Event = Callable[[str, dict], None]  # (kind, fields): stage, augment, tokenized, step, checkpoint, exported


def check_model(flag: str, spec: str | None) -> None:
    """Refuse a model that cannot load before anything is written: it must resolve, and a GGUF file must pass
    the header and metadata checks every loader runs (:func:`zoomr.backends.gguf_file.check_gguf`; the
    header only, no weights are read).

    Raises:
        UserError: ``{flag}: {why}`` (one line).
    """
    from zoomr.backends.gguf_file import check_gguf

    try:
        src = resolve_model(spec)
        if src.kind == "gguf":
            check_gguf(src.path)
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None


def _shown(key: str, value) -> str:
    return "the embedded model" if value is None and key in ("model", "summarizer") else repr(value)


def prepare_out(cfg: FinetuneConfig) -> None:
    """Check ``--out`` against ``--resume`` / ``--force`` and record the settings.

    Raises:
        UserError: ``out`` exists (non-empty) without either flag; ``--resume`` of a directory that is not a
            finetune run or was made with other fixed settings; ``--force`` on a non-empty directory that is
            not a finetune run (never deleted); ``--resume`` with ``--force``.
    """
    out, run_file = cfg.out, cfg.out / RUN_FILE
    if cfg.resume and cfg.force:
        raise UserError("--resume and --force exclude each other")
    exists = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if exists and not (cfg.resume or cfg.force):
        raise UserError(f"--out {out}: already exists; --resume continues that run, --force starts over")
    if exists and cfg.force:
        if cfg.augmented is not None and out.resolve() in cfg.augmented.resolve().parents:
            raise UserError(f"--force would delete --augmented {cfg.augmented} (it is inside --out {out}); "
                            "copy it out first, or use --resume")
        if not run_file.is_file():
            raise UserError(f"--out {out}: not a zoomr finetune directory (no {RUN_FILE}); not deleting it")
        shutil.rmtree(out)
    if exists and cfg.resume:
        if not run_file.is_file():
            raise UserError(f"--out {out}: nothing to resume (no {RUN_FILE})")
        old = json.loads(run_file.read_text())
        new = cfg.settings()
        changed = [k for k in _FIXED if old.get(k) != new.get(k)]
        if changed:
            k = changed[0]
            raise UserError(f"--resume: {k} was {_shown(k, old.get(k))} in {out}, now {_shown(k, new.get(k))} "
                            "(start over with --force)")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(cfg.settings(), indent=1))


def augment_stage(cfg: FinetuneConfig, count_tokens, on_event: Event) -> list[Augmented]:
    """The augmented traces: read from ``--augmented``, or made from DATA (continuing ``augmented.jsonl``).

    Raises:
        UserError: bad DATA / augmented file, or a summarizer that cannot be loaded.
    """
    path = cfg.out / AUGMENTED
    if cfg.augmented is not None:
        rows = [Augmented.from_json(r, f"--augmented {cfg.augmented}")
                for r in read_jsonl(cfg.augmented, "--augmented", cfg.limit)]
        if cfg.augmented.resolve() != path.resolve():
            path.write_text("".join(json.dumps(a.to_json()) + "\n" for a in rows))
        return rows
    traces = read_traces(cfg.data, cfg.limit)
    done = [Augmented.from_json(r, str(path)) for r in read_jsonl(path, "augmented")] if path.is_file() and \
        path.stat().st_size else []
    on_event("augment", {"done": len(done), "total": len(traces)})
    if len(done) < len(traces):
        from .summarizer import Summarizer

        summarize = Summarizer(cfg.summarizer, cfg.summary_tokens)
        with open(path, "a", encoding="utf-8") as f:
            for k in range(len(done), len(traces)):
                a = augment_trace(k, *traces[k], summarize, count_tokens, cfg.paragraph_tokens)
                f.write(json.dumps(a.to_json()) + "\n")
                f.flush()
                os.fsync(f.fileno())
                done.append(a)
                on_event("augment", {"done": len(done), "total": len(traces)})
    return done[:len(traces)]


def pick_device(spec: str):
    """The torch device for training, resolved as every torch-backend command resolves ``--device``
    (:func:`zoomr.backends.torch.engine.pick_device`: ``auto`` → CUDA when available, else CPU).

    Raises:
        UserError: an unknown device, or CUDA asked for where torch sees none (one line).
    """
    from zoomr.backends.torch.engine import pick_device as resolve

    try:
        return resolve(spec)
    except ValueError as e:
        raise UserError(str(e)) from None


def run_finetune(cfg: FinetuneConfig, on_event: Event = lambda kind, info: None) -> dict:
    """Run (or continue) the whole pipeline; returns the summary written into the model card.

    Raises:
        UserError: bad input (see the stages); CheckpointError (a UserError) on a full disk.
        KeyboardInterrupt: after the training stage saved a checkpoint.
    """
    from .data import encode_example
    from .export import export_merged, model_card, plot_losses
    from .hf_model import (delimiter_ids, delimiter_init, existing_delimiters, load_weights, transformers_model,
                           write_tokenizer)
    from .train import Trainer, disk_full, peft_model

    cfg.train.validate()
    if cfg.data is None and cfg.augmented is None:
        raise UserError("give DATA (a JSONL of reasoning traces) or --augmented PATH")
    # bad input is refused before anything is loaded or written
    device = pick_device(cfg.device)
    check_model("-m", cfg.model)
    existing = existing_delimiters(resolve_model(cfg.model))
    if cfg.augmented is None:
        read_traces(cfg.data, cfg.limit)
        check_model("--summarizer", cfg.summarizer)
    else:
        for r in read_jsonl(cfg.augmented, "--augmented", cfg.limit):
            Augmented.from_json(r, f"--augmented {cfg.augmented}")
    t0 = time.monotonic()
    prepare_out(cfg)
    on_event("stage", {"name": "load model"})
    src, mcfg, tensors = load_weights(cfg.model)
    tok = write_tokenizer(src, cfg.out)
    on_event("stage", {"name": "augment"})
    rows = augment_stage(cfg, lambda s: len(tok.encode(s, special=False)), on_event)
    counts = rejection_counts(rows)
    on_event("augmented", counts)
    examples = [e for e in (encode_example(tok, a.problem, a.augmented, cfg.train.seq_len) for a in rows) if e]
    if not examples:
        raise UserError(f"--seq-len {cfg.train.seq_len}: every prompt is at least that long; no example to train on")
    on_event("tokenized", {"examples": len(examples), "tokens": sum(len(e.ids) for e in examples)})
    on_event("stage", {"name": "train"})
    import transformers

    transformers.logging.set_verbosity_error()
    # peft asks transformers a deprecated question on every forward; the answer is right, the warning noise
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    model = peft_model(transformers_model(mcfg, tensors, tok.vocab_size, delimiter_init(tok, existing)), cfg.train,
                       delimiter_ids(tok))
    del tensors
    pad = tok.eos_ids and min(tok.eos_ids) or 0
    trainer = Trainer(model, examples, cfg.train, pad, cfg.out / "checkpoints", device)
    start = trainer.resume() if cfg.resume else 0
    on_event("train", {"step": start, "steps": cfg.train.steps})
    trainer.run(on_step=lambda s, loss: on_event("step", {"step": s, "steps": cfg.train.steps, "loss": loss}),
                on_checkpoint=lambda s: on_event("checkpoint", {"step": s}))
    on_event("stage", {"name": "export"})
    model.to("cpu")
    try:
        export_merged(model, mcfg, cfg.out)
        plot_losses(trainer.losses, cfg.out / "loss.png")
    except Exception as e:
        if not disk_full(e):
            raise
        raise UserError(f"cannot write the merged model into {cfg.out}: no space ({e}); the checkpoint of step "
                        f"{trainer.step} is intact: free space, then --resume exports again") from None
    summary = {"examples": len(examples), "counts": counts, "steps": trainer.step, "losses": trainer.losses,
               "seconds": time.monotonic() - t0}
    (cfg.out / "README.md").write_text(model_card(
        directory=str(cfg.out), base=src.name, data=str(cfg.augmented or cfg.data), examples=len(examples),
        summarizer=f"an earlier run ({cfg.augmented})" if cfg.augmented else (cfg.summarizer or "the embedded model"),
        counts=counts, train=asdict(cfg.train), losses=trainer.losses, command=cfg.command,
        seconds=summary["seconds"]))
    on_event("exported", {"out": str(cfg.out)})
    return summary
