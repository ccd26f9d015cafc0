"""The bench's crash-safe record log: one JSON line per finished (problem, policy, budget), appended and
fsynced as soon as it exists, so ``--resume`` after any crash or ``kill -9`` redoes nothing and loses nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path


REQUIRED = {"problem_id", "policy", "budget", "correct", "mean_active_tokens", "tokens_generated"}


def record_key(problem_id: str, policy: str, budget: int | None) -> tuple[str, str, int | None]:
    """The identity of a record: which problem, which policy, which budget (None for full KV)."""
    return (str(problem_id), policy, budget)


class RecordLog:
    """Append-only JSONL of bench records.

    On open, a torn last line (the process died mid-write) is cut off, so every line in the file is a
    complete record.

    Args:
        path: the ``records.jsonl`` file (created if missing).
    Raises:
        ValueError: a complete line in the middle of the file is not JSON (the file is not ours).
    """

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        if path.exists():
            data = path.read_bytes()
            good = data[: data.rfind(b"\n") + 1]
            if len(good) != len(data):
                with open(path, "r+b") as f:  # drop the torn tail
                    f.truncate(len(good))
            try:
                text = good.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}: not a bench record file (not UTF-8 text)") from None
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        rec = None
                    if not isinstance(rec, dict) or not REQUIRED <= rec.keys():
                        raise ValueError(f"{path}:{n}: not a bench record")
                    self.records.append(rec)
        self.done = {record_key(r["problem_id"], r["policy"], r["budget"]) for r in self.records}

    def append(self, record: dict) -> None:
        """Write one record durably (flush + fsync) and remember its key."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self.done.add(record_key(record["problem_id"], record["policy"], record["budget"]))
