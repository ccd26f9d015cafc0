"""The fine-tuned model as a HF directory zoomr loads (``zoomr solve -m DIR --policy zoomr --summaries model``),
with its model card.

The adapter is merged into the weights (peft ``merge_and_unload``), written with zoomr's own writer
(:func:`zoomr.backends.torch.weights.write_hf_dir`: ``config.json`` + ``model.safetensors``, float32) next to
the tokenizer files that carry the delimiters as special tokens and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from zoomr.backends.torch.config import ModelConfig

from .hf_model import merged_tensors


def export_merged(peft_model, cfg: ModelConfig, out: Path) -> ModelConfig:
    """Merge the adapter of ``peft_model`` and write ``config.json`` + ``model.safetensors`` into ``out``.

    Returns:
        the written configuration (vocabulary with the delimiters).
    Raises:
        OSError: ``out`` cannot be written.
    """
    from zoomr.backends.torch.weights import write_hf_dir

    merged = peft_model.merge_and_unload()
    new_cfg, tensors = merged_tensors(merged, cfg)
    write_hf_dir(new_cfg, tensors, out)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return new_cfg


def plot_losses(losses: list[float], path: Path) -> None:
    """Loss curve PNG: per-step mean token loss (nats) and its running mean over 10 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="step")
    w = 10
    smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, lw=1.6, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / assistant token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def model_card(*, directory: str, base: str, data: str, summarizer: str, examples: int, counts: dict, train: dict, losses: list[float],
               command: str, seconds: float) -> str:
    """The README.md of the exported directory: base model, data, augmentation counts, knobs, loss curve,
    how to run it and the command that made it."""
    first = sum(losses[:10]) / max(1, len(losses[:10]))
    last = sum(losses[-10:]) / max(1, len(losses[-10:]))
    knobs = "\n".join(f"| `{k}` | {v} |" for k, v in train.items())
    return f"""# ZoomR summary fine-tune of {base}

LoRA fine-tune that teaches the model to write a summary after each paragraph of its reasoning, between
`<|begin_of_summary|>` and `<|end_of_summary|>` (special tokens of this tokenizer), as ZoomR §3.2 describes.
Made by `zoomr finetune`.

Run it with ZoomR's multi-granularity KV selection over its own summaries:

```bash
zoomr solve problem.txt -m {directory} --policy zoomr --summaries model
```

## Data

- traces: `{data}`, {examples} examples; summaries written by {summarizer}
- paragraphs: {counts.get('paragraphs', 0)}; summaries rejected and replaced by an extractive one:
  {counts.get('rejected', 0)} (empty {counts.get('empty', 0)}, not shorter {counts.get('longer', 0)},
  copy {counts.get('copy', 0)})
- augmented traces: `augmented.jsonl`

## Training

| knob | value |
|---|---|
{knobs}

Loss (nats per assistant token): first 10 steps {first:.3f}, last 10 steps {last:.3f}; {len(losses)} steps
in {seconds:.0f} s.

![loss curve](loss.png)

## Made with

```bash
{command}
```
"""
