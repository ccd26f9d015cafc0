"""``zoomr calibrate``: TriAttention's query statistics of a model, computed now and cached (or written to a file).

``--policy triattention`` calibrates on first use by itself; this command does it ahead of time (a bench's first
cell then does not include it), with more text (``--tokens``), or into a file for ``--stats-file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from zoomr.backends.torch.calibrate import DEFAULT_TOKENS, MAX_TOKENS


def calibrate_command(
    model: Annotated[Optional[str], typer.Option("-m", "--model", help="GGUF file, HF model directory or hub id "
                                                 "(default: the embedded SmolLM2-135M-Instruct).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help=f"Tokens of calibration text (zoomr's own source files), "
                                        f"up to {MAX_TOKENS}.")] = DEFAULT_TOKENS,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Write the statistics to this file (for "
                                                "--stats-file) instead of the model's cache entry.",
                                                show_default="the cache")] = None,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA if present), cpu, cuda, cuda:N.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: auto (a GGUF's blocks in the int4 kernel, in "
                                       "the CPU's faster half dtype), fp32, bf16, fp16.")] = "auto",
    threads: Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads (default: all cores).",
                                                   min=1)] = None,
) -> int:
    """Compute a model's TriAttention query statistics (one forward pass over text, torch backend) and cache them
    for --policy triattention on both backends; replaces a cached entry."""
    from zoomr.backends.models import resolve_model
    from zoomr.backends.torch.calibrate import calibrate_to_file, calibration_backend, check_tokens

    check_tokens(tokens)   # before the model loads
    backend = calibration_backend(resolve_model(model), device, dtype, threads, tokens)
    path = calibrate_to_file(backend, tokens, out)
    print(f"wrote {path}")
    return 0
