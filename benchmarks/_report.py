"""What every benchmark script does with its record: ``--json PATH`` writes it there, ``--json -`` to stdout."""

from __future__ import annotations

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
