"""Reading user-provided text (problem files, stdin) and writing ``--json`` records, with clear failures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zoomr.errors import UserError


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
        UserError: the parent directory does not exist or PATH is a directory.
    """
    if path is None or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--json {path}: is a directory")
    if not p.parent.exists():
        raise UserError(f"--json {path}: directory {p.parent} does not exist")


def write_json(path: str, record: dict, indent: int) -> str:
    """Write ``record`` as JSON to ``path`` (``-``: stdout, the only thing written there); returns where, in words."""
    text = json.dumps(record, indent=indent, ensure_ascii=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return "stdout"
    Path(path).write_text(text)
    return path
