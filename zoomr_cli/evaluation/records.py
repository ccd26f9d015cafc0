"""The bench's crash-safe record log: one JSON line per finished (problem, policy, budget), appended and
fsynced as soon as it exists, so ``--resume`` after any crash or ``kill -9`` redoes nothing and loses nothing;
and the run's ``config.json``, read back checked and written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

from zoomr.evaluation.atomic import write_atomic


REQUIRED = {"problem_id", "policy", "budget", "correct", "mean_active_tokens", "tokens_generated"}
MATCHED = "matched"  # the budget of a matched-budget cell (chosen per problem, see zoomr bench --match-budget)
# the policy names of bench --rescue's cells (zoomr.evaluation.rescue_cells): not policies of the registry;
# full-best-of-n is best-of-N on full KV, the sampled reference of the recovered fraction
RESCUE, BEST_OF_N, FULL_BEST_OF_N = "rescue", "best-of-n", "full-best-of-n"
RESCUE_CELLS = (RESCUE, BEST_OF_N, FULL_BEST_OF_N)
DUPLICATES_SHOWN = 8  # keys a duplicates note names (then "and N more")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# What the bench's table, summary and plots read from a record, by kind: a resumed file whose record breaks
# one of these is refused when it is opened (line and field named) rather than failing after the new cells.
_KINDS = {
    "problem_id": (lambda v: isinstance(v, str), "a string"),
    "policy": (lambda v: isinstance(v, str) and v != "", "a policy name"),
    "budget": (lambda v: v is None or v == MATCHED or _count(v), f'a token count, null or "{MATCHED}"'),
    "correct": (lambda v: isinstance(v, bool), "true or false"),
    "mean_active_tokens": (_number, "a number"),
    "tokens_generated": (_count, "a token count"),
}
_OPTIONAL_NUMBERS = ("fidelity_top1", "fidelity_kl", "peak_active_tokens", "bound_tokens", "mean_active_bytes",
                     "full_bytes", "mean_full_bytes", "peak_active_bytes", "device_kv_bytes", "host_kv_bytes",
                     "decode_tok_s", "n_boxed_distinct", "budget_tokens", "target_active_tokens", "match_error",
                     "helper_share", "base_tokens", "method_kv_bytes_mean", "saving", "saving_peak",
                     "policy_state_bytes", "mean_policy_state_bytes", "target_peak_active_tokens")


def _kind(v) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def record_problem(line: str) -> str | None:
    """Why one JSONL line is not a bench record (``None`` when it is one).

    A record is a JSON object with every :data:`REQUIRED` field, each of its kind, and the numeric fields the
    summaries average (``fidelity_*``, ``*_bytes``, ``decode_tok_s`` ...) numbers or null; ``active_trace``
    (the plotted curve) a list of [generated tokens, active tokens] pairs.
    """
    try:
        rec = json.loads(line)
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError:  # not JSON, or an integer of more than 4300 digits
        return "not JSON"
    if not isinstance(rec, dict):
        return f"{_kind(rec)}, not an object"
    missing = sorted(REQUIRED - rec.keys())
    if missing:
        return f"no {', '.join(missing)}"
    for key, (ok, want) in _KINDS.items():
        if not ok(rec[key]):
            return f"{key} is {_kind(rec[key])}, expected {want}"
    for key in _OPTIONAL_NUMBERS:
        if rec.get(key) is not None and not _number(rec[key]):
            return f"{key} is {_kind(rec[key])}, expected a number or null"
    trace = rec.get("active_trace")
    if trace is not None and not (isinstance(trace, list)
                                  and all(isinstance(p, list) and len(p) == 2 and all(map(_number, p)) for p in trace)):
        return "active_trace is not a list of [tokens, tokens] pairs"
    return None


def _parses(raw: bytes) -> bool:
    """True when ``raw`` is UTF-8 JSON: what a write torn part-way through a line can never be."""
    try:
        json.loads(raw.decode("utf-8"))
        return True
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


def record_key(problem_id: str, policy: str, budget: int | None) -> tuple[str, str, int | None]:
    """The identity of a record: which problem, which policy, which budget (None for full KV)."""
    return (str(problem_id), policy, budget)


def key_label(key: tuple) -> str:
    """A record key as a person reads it: ``problem 3 rkv B=32`` (no ``B=`` for a policy that sizes itself)."""
    problem_id, policy, budget = key
    return f"problem {problem_id} {policy}" + ("" if budget is None else f" B={budget}")


class RecordLog:
    """Append-only JSONL of bench records.

    On open, every line is checked (:func:`record_problem`) before anything is changed: a file with a line
    that is not a record is refused and left as it is. A last line without its ``\\n`` that is not UTF-8
    JSON is a write the process died in, and is cut off (:attr:`torn_bytes`); one that is JSON only lacks its
    line end (it is kept and terminated when it is a record). Every line before it stays byte for byte as it
    was. Lines end at ``\\n`` only: U+2028 and the other separators :meth:`str.splitlines` splits at may
    stand unescaped in a record's text.

    A key recorded twice (two runs writing one folder at once, before bench locked its folder:
    :mod:`zoomr.evaluation.folder_lock`) is read once: :attr:`records` keeps its first record, the file keeps
    every line, and :attr:`duplicates` names the key (:meth:`notes` says so in one line).

    Args:
        path: the ``records.jsonl`` file (created if missing).
    Attributes:
        records: one record per key, in file order; done: their keys.
        duplicates: the keys found more than once, each once, in file order.
        torn_bytes: bytes of a torn last line cut off on open (0: none).
    Raises:
        ValueError: a line is not a bench record, or the file is not UTF-8 (it is not ours); one line
            naming the file and the line.
    """

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        self.duplicates: list[tuple] = []
        self.torn_bytes = 0
        self._keys: set = set()
        if path.exists():
            data = path.read_bytes()
            cut = data.rfind(b"\n") + 1
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not a bench record file (not UTF-8 text at byte {e.start})") from None
            lines = text.split("\n")[:-1]
            for n, line in enumerate(lines, 1):
                if line.strip(" \t\r"):  # JSON's whitespace: a blank line is no record, anything else must be one
                    why = record_problem(line)
                    if why is not None:
                        raise ValueError(f"{path}:{n}: not a bench record ({why})")
                    self._keep(json.loads(line))
            tail = data[cut:]
            if tail.strip(b" \t\r") and _parses(tail):  # not a torn write: a line whose end is missing
                why = record_problem(tail.decode("utf-8"))
                if why is not None:
                    raise ValueError(f"{path}:{len(lines) + 1}: not a bench record ({why})")
                self._keep(json.loads(tail))
                with open(path, "ab") as f:
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
            elif tail:
                with open(path, "r+b") as f:  # drop the torn tail
                    f.truncate(cut)
                    os.fsync(f.fileno())
                self.torn_bytes = len(tail)
        self.done = {record_key(r["problem_id"], r["policy"], r["budget"]) for r in self.records}

    def _keep(self, record: dict) -> None:
        """Add a record read from the file unless its key came before (then name the key once)."""
        key = record_key(record["problem_id"], record["policy"], record["budget"])
        if key in self._keys:
            if key not in self.duplicates:
                self.duplicates.append(key)
            return
        self._keys.add(key)
        self.records.append(record)

    def notes(self) -> list[str]:
        """What opening the file changed or chose, one line each: a torn last line cut off, keys read once."""
        lines = []
        if self.torn_bytes:
            lines.append(f"{self.path}: dropped a torn last line ({self.torn_bytes} bytes: a write cut off "
                         "mid-line); every complete record is kept")
        if self.duplicates:
            shown = ", ".join(key_label(k) for k in self.duplicates[:DUPLICATES_SHOWN])
            more = len(self.duplicates) - DUPLICATES_SHOWN
            lines.append(f"{self.path}: {len(self.duplicates)} cell(s) recorded more than once ({shown}"
                         f"{f' and {more} more' if more > 0 else ''}; two runs wrote this folder at once): "
                         "the first record of each is used, the file keeps them all")
        return lines

    def append(self, record: dict) -> None:
        """Write one record durably (flush + fsync) and remember its key."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self.done.add(record_key(record["problem_id"], record["policy"], record["budget"]))


def read_config(path: Path) -> dict:
    """The settings a bench folder's earlier run recorded in ``config.json``.

    Raises:
        ValueError: not UTF-8 JSON, not an object, or a ``provenance`` that is not an object of text (or
            null) values where the resume reads them (``model_sha256``, ``model_path``); one line.
    """
    try:
        old = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{path}: not a bench config (not JSON); remove it or choose another --out") from None
    if not isinstance(old, dict):
        raise ValueError(f"{path}: not a bench config ({_kind(old)}, not an object); remove it or choose another --out")
    prov = old.get("provenance")
    if prov is not None and not (isinstance(prov, dict) and all(
            prov.get(k) is None or isinstance(prov[k], str) for k in ("model_sha256", "model_path"))):
        raise ValueError(f"{path}: not a bench config (its provenance is not an object of texts); remove it or "
                         "choose another --out")
    return old


def write_config(path: Path, config: dict) -> None:
    """Write ``config.json`` atomically (:func:`zoomr.evaluation.atomic.write_atomic`): a crash mid-write leaves
    the earlier run's settings, never half a file that would make the folder's records unresumable."""
    write_atomic(path, json.dumps(config, indent=2))


TIMING_FIELDS = ("decode_tok_s", "prefill_tok_s", "wall_s")  # seconds-derived: differ run to run
WORKER_FIELDS = ("worker_host", "worker_pid")  # which Ray worker ran a cell (zoomr bench --ray): differ run to run


def record_differences(a: list[dict], b: list[dict], kl_rel: float = 1e-4) -> list[str]:
    """How two benches' records of the same cells differ, in any order, timings (:data:`TIMING_FIELDS`) and the
    Ray worker that ran each cell (:data:`WORKER_FIELDS`) aside.

    ``fidelity_kl`` may differ by ``kl_rel`` relative (and 1e-9 nats): a float64 sum over logits whose last
    bits depend on the batch's matmul shapes, which is what ``-np`` changes.

    Returns:
        one line per difference (a cell only one side has, a field that differs), empty when they agree.
    """
    ka = {record_key(r["problem_id"], r["policy"], r["budget"]): r for r in a}
    kb = {record_key(r["problem_id"], r["policy"], r["budget"]): r for r in b}
    out = [f"{k}: only in the {side}" for k, side in [(k, "first") for k in ka.keys() - kb.keys()]
           + [(k, "second") for k in kb.keys() - ka.keys()]]
    if len(ka) != len(a) or len(kb) != len(b):
        out.append("a cell is recorded twice")
    for k in ka.keys() & kb.keys():
        for field in sorted(ka[k].keys() | kb[k].keys()):
            x, y = ka[k].get(field), kb[k].get(field)
            if field in TIMING_FIELDS + WORKER_FIELDS or x == y:
                continue
            if field == "fidelity_kl" and _number(x) and _number(y) and abs(x - y) <= max(1e-9, kl_rel * abs(x)):
                continue
            out.append(f"{k} {field}: {x!r} vs {y!r}")
    return sorted(out)
