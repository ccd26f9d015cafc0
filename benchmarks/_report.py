"""What the benchmark scripts share: the model/engine flags, and ``--json PATH`` (``-``: stdout) for the record."""

from __future__ import annotations

import argparse
import json


def write_json(record: dict, dest: str | None) -> None:
    """Write ``record`` as indented JSON to ``dest`` (a path, ``-`` for stdout, None for nowhere)."""
    if not dest:
        return
    text = json.dumps(record, indent=1)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def engine_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the flags every torch-vs-llama.cpp benchmark takes: -m, -t (default 2), --device, --dtype,
    --quant (the torch backend's ``--quant``; default none: dense weights in ``--dtype``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", help="torch dtype: fp32, bf16")
    ap.add_argument("--quant", default="none", help="torch weights: none, auto, int4, int8, fp16")
    return ap
