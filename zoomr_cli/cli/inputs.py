"""Reading user-provided text (problem files, stdin) and writing ``--json`` records, with clear failures."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from zoomr.errors import UserError
from zoomr.evaluation.bench_log import unwritable


def read_text_input(path: str) -> str:
    """Text of ``path`` (``-`` for stdin), UTF-8, non-empty, stripped; a leading byte-order mark is dropped
    and Windows line ends (CRLF) become ``\\n``, so a file saved on Windows is the same problem.

    Memory: at the peak two copies, the bytes and the text or two texts (a 1 MB ASCII file holds about 2 MB
    while it is read; Python stores every character of a text in 4 bytes once one lies beyond U+FFFF, so
    the worst case is about 8 MB).

    Raises:
        UserError: missing file, a directory, unreadable, binary (NUL bytes or not UTF-8), or empty.
    """
    if path == "-":
        data = sys.stdin.buffer.read()
        where = "stdin"
    else:
        p = Path(path)
        if not p.exists():
            raise UserError(f"{path}: no such file")
        if p.is_dir():
            raise UserError(f"{path}: is a directory, expected a text file")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read ({e.strerror})") from None
        where = path
    if b"\x00" in data:
        raise UserError(f"{where}: looks binary (contains NUL bytes), expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not valid UTF-8 (byte {e.start})") from None
    del data  # the bytes go before the copies below are made; one step at a time keeps two copies at most
    text = text.removeprefix("\ufeff")
    text = text.strip()
    text = text.replace("\r\n", "\n")
    if not text:
        raise UserError(f"{where}: is empty")
    return text


def check_writable(path: str | None) -> None:
    """Fail early, before any compute, when ``--json PATH`` cannot be written.

    ``-`` is stdout (always writable).

    Raises:
        UserError: the parent directory does not exist, PATH is a directory, or a file cannot be made there
            (read-only file system, no permission; tried by creating and removing a scratch file).
    """
    if path is None or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--json {path}: is a directory")
    if not p.parent.exists():
        raise UserError(f"--json {path}: directory {p.parent} does not exist")
    why = unwritable(p.parent)
    if why is None and p.exists() and not os.access(p, os.W_OK):
        why = "permission denied"
    if why is not None:
        raise UserError(f"--json {path}: cannot write there ({why})")


def write_json(path: str, record: dict, indent: int) -> str:
    """Write ``record`` as JSON to ``path`` (``-``: stdout, the only thing written there); returns where, in words.

    The file is written beside ``path`` and renamed over it, so a failed write leaves no half record.
    When ``path`` cannot be written after all (the disk filled up during the run), the record goes to a
    file in the temporary directory instead, so nothing computed is lost.

    Raises:
        UserError: ``path`` could not be written (the message names where the record went instead, or
            that it could not be saved anywhere).
    """
    text = json.dumps(record, indent=indent, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return "stdout"
    try:
        _write_replacing(Path(path), text)
        return path
    except OSError as e:
        why = e.strerror or str(e)
    fallback = Path(tempfile.gettempdir()) / f"zoomr-{os.getpid()}-{Path(path).name or 'record.json'}"
    try:
        _write_replacing(fallback, text)
    except OSError:
        raise UserError(f"--json {path}: cannot write ({why}); the record could not be saved") from None
    raise UserError(f"--json {path}: cannot write ({why}); the record was written to {fallback} instead")


def _write_replacing(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
