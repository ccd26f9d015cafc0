"""A tied GGUF model as an UNTIED HF directory: the LM head written out as its own copy of the token
embedding (issue 28), so that a fine-tune of it (``zoomr finetune -m DIR``) must train a separate head,
as it must for the papers' own untied models (DeepSeek-R1-Distill-Qwen-7B, Qwen2.5-7B).

The weights are read by zoomr's loader (GGUF dequantized to float32) and written by its own writer
(:func:`zoomr.backends.torch.weights.write_hf_dir`: ``config.json`` with ``tie_word_embeddings: false`` +
``model.safetensors``); the tokenizer is converted from the GGUF's vocabulary (``tokenizer.json`` +
``tokenizer_config.json`` with the chat template), without the summary delimiters, which the fine-tune
adds. Right after writing, the untied model's logits are unchanged: the head is an exact copy.

    python benchmarks/untie_model.py OUT_DIR [-m MODEL.gguf]     # default: the embedded model
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path


def untie(model: str | None, out: Path) -> Path:
    """Write the untied HF directory of ``model`` (a tied GGUF; None: the embedded model) into ``out``.

    Returns:
        ``out``.
    Raises:
        ValueError: the model cannot be resolved or read, or is not a tied GGUF model.
        OSError: ``out`` cannot be written.
    """
    from zoomr.backends.hf_tokenizer import write_hf_tokenizer
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.weights import load_gguf, write_hf_dir

    src = resolve_model(model)
    if src.kind != "gguf":
        raise ValueError(f"{src.path}: not a GGUF file")
    cfg, tensors, _ = load_gguf(src.path)
    if not cfg.tied_embeddings:
        raise ValueError(f"{src.path}: the LM head is already untied")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_hf_dir(replace(cfg, tied_embeddings=False), tensors, out)
    write_hf_tokenizer(src.path, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="directory to write (config.json, model.safetensors, tokenizer files)")
    ap.add_argument("-m", "--model", default=None, help="a tied GGUF model (default: the embedded model)")
    args = ap.parse_args()
    try:
        print(untie(args.model, Path(args.out)))
    except ValueError as e:
        sys.exit(f"untie_model: {e}")


if __name__ == "__main__":
    main()
