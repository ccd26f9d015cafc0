"""``zoomr finetune``: summary augmentation + LoRA fine-tune + export (ZoomR §3.2), with progress bars."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from zoomr.finetune.augment import DEFAULT_PARAGRAPH_TOKENS
from zoomr.finetune.pipeline import FinetuneConfig, run_finetune
from zoomr.finetune.summarizer import DEFAULT_SUMMARY_TOKENS
from zoomr.finetune.train import TrainConfig

_D = TrainConfig()


def finetune_command(
    data: Annotated[Optional[Path], typer.Argument(help="JSONL of reasoning traces: question+answer (GSM8K) or "
                                                   "problem+solution (MATH) per line.", show_default=False)] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory: augmented.jsonl, checkpoints/, then "
                                      "the merged HF model and its README.md.")] = Path("finetune_out"),
    model: Annotated[Optional[str], typer.Option("-m", "--model", help="Model to fine-tune (GGUF, HF directory or "
                                                 "hub id). Default: the embedded model.")] = None,
    summarizer: Annotated[Optional[str], typer.Option("--summarizer", help="Model that writes the paragraph "
                                                      "summaries. Default: the embedded model.")] = None,
    augmented: Annotated[Optional[Path], typer.Option("--augmented", help="Train on this augmented.jsonl (from "
                                                      "an earlier run) instead of augmenting DATA.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Use only the first N examples.", min=1)] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.", min=1)] = _D.steps,
    batch: Annotated[int, typer.Option("--batch", help="Examples per step.", min=1)] = _D.batch,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Most tokens per example (prompt + solution).",
                                         min=16)] = _D.seq_len,
    rank: Annotated[int, typer.Option("--rank", help="LoRA rank.", min=1)] = _D.rank,
    alpha: Annotated[int, typer.Option("--alpha", help="LoRA alpha.", min=1)] = _D.alpha,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW; warmup, then cosine).")] = _D.lr,
    token_lr: Annotated[float, typer.Option("--token-lr", help="Peak learning rate of the two delimiter "
                                            "embedding rows (their own AdamW group).")] = _D.token_lr,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Steps between checkpoints.",
                                                  min=1)] = _D.checkpoint_every,
    summary_tokens: Annotated[int, typer.Option("--summary-tokens", help="Most tokens per generated summary.",
                                                min=1)] = DEFAULT_SUMMARY_TOKENS,
    paragraph_tokens: Annotated[int, typer.Option("--paragraph-tokens", help="Target paragraph length when "
                                                  "one-step-per-line solutions are grouped.",
                                                  min=1)] = DEFAULT_PARAGRAPH_TOKENS,
    device: Annotated[str, typer.Option("--device", help="Training device: auto, cpu, cuda[:N].")] = "auto",
    seed: Annotated[int, typer.Option("-s", "--seed", help="Batch order and dropout seed.")] = _D.seed,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out (augmentation and "
                                         "training pick up where they stopped).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Delete an earlier finetune run in --out first.")] = False,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain progress lines instead of bars.")] = False,
) -> int:
    """Teach a model to summarize each paragraph of its reasoning (ZoomR §3.2): augment traces with summaries,
    LoRA fine-tune, write a HF directory for `zoomr solve -m DIR --policy zoomr --summaries model`."""
    train = TrainConfig(steps=steps, batch=batch, seq_len=seq_len, rank=rank, alpha=alpha, lr=lr, token_lr=token_lr,
                        checkpoint_every=checkpoint_every, seed=seed)
    cfg = FinetuneConfig(data=data, out=out, model=model, summarizer=summarizer, augmented=augmented, limit=limit,
                         summary_tokens=summary_tokens, paragraph_tokens=paragraph_tokens, train=train,
                         resume=resume, force=force, device=device,
                         command="zoomr " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["finetune"] else
                         "zoomr finetune")
    err = Console(stderr=True, soft_wrap=True)
    live = not no_live and err.is_terminal
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[note]}"), console=err)
    tasks: dict[str, int] = {}

    def bar(name: str, total: int, done: int, note: str = "") -> None:
        if name not in tasks:
            tasks[name] = progress.add_task(name, total=total, completed=done, note=note)
        progress.update(tasks[name], completed=done, total=total, note=note)

    def on_event(kind: str, info: dict) -> None:
        if kind == "stage":
            err.print(f"· {info['name']}")
        elif kind == "augment":
            bar("augment", info["total"], info["done"])
            if not live and info["done"] == info["total"]:
                err.print(f"augmented {info['done']} traces")
        elif kind == "augmented":
            err.print(f"summaries: {info['paragraphs']} paragraphs, {info['rejected']} rejected and replaced by an "
                      f"extractive summary (empty {info['empty']}, not shorter {info['longer']}, copy {info['copy']})")
        elif kind == "tokenized":
            err.print(f"{info['examples']} examples, {info['tokens']} tokens")
        elif kind == "train":
            bar("train", info["steps"], info["step"])
            if info["step"]:
                err.print(f"resumed at step {info['step']}")
        elif kind == "step":
            bar("train", info["steps"], info["step"], f"loss {info['loss']:.3f}")
            if not live:
                err.print(f"step {info['step']}/{info['steps']} loss {info['loss']:.4f}")
        elif kind == "checkpoint":
            if not live:
                err.print(f"checkpoint at step {info['step']}")
        elif kind == "exported":
            err.print(f"wrote {info['out']}: zoomr solve problem.txt -m {info['out']} --policy zoomr --summaries model")

    if live:
        progress.start()
    try:
        summary = run_finetune(cfg, on_event)
    except KeyboardInterrupt:
        err.print(f"interrupted: what was done is kept in {out} (training saves a checkpoint); --resume continues")
        raise
    finally:
        if live:
            progress.stop()
    losses = summary["losses"]
    if losses:
        print(f"steps {summary['steps']} · loss {losses[0]:.3f} → {losses[-1]:.3f} · {summary['seconds']:.0f} s · {out}")
    return 0
