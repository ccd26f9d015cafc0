"""Whole files or none: every file a bench writes besides its record log (``summary.json``, ``config.json``, the
plots, the folder lock's holder file) is written under a temporary name in the same folder, fsynced and renamed
over its name, so a reader (or a run after a power loss) sees the old file or the new one, never half of one.

``os.replace`` is atomic within one file system on POSIX and Windows; the temporary file sits in the target's
folder for that reason (``/tmp`` may be another file system). Source: the POSIX ``rename(2)`` contract, the
pattern SQLite's and git's lock files follow.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator

TEMP_PREFIX = ".zoomr-tmp-"  # what a writer killed mid-write may leave behind: never a name readers open


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed over ``path`` when the ``with`` block ends without an error.

    The temporary name keeps ``path``'s extension (``.png`` stays ``.png``), so a writer that picks its format
    from the name (matplotlib's ``savefig``) still does. The block writes the file; it is fsynced here before
    the rename, and the folder after it (where the OS allows opening a folder). On an error the temporary file
    is removed and ``path`` is left as it was.

    Raises:
        OSError: the folder is not writable, the disk is full; whatever the block raises.
    """
    tmp = _create_temp(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_folder(path.parent)


def _create_temp(path: Path) -> Path:
    """An empty new file beside ``path`` with a name no other writer holds. Created with mode 0o666 less the
    umask, as ``open()`` would create ``path`` itself (``tempfile.mkstemp``'s 0o600 would make a shared
    bench folder's summary unreadable to the group)."""
    for _ in range(100):
        tmp = path.with_name(f"{TEMP_PREFIX}{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{path.suffix}")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all (:func:`replacing`).

    Raises:
        OSError: as :func:`replacing`.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path) as tmp:
        tmp.write_bytes(raw)


def _sync_folder(folder: Path) -> None:
    """fsync the folder so the rename itself survives a power loss (POSIX; Windows cannot open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
