"""One writer per bench folder: an exclusive OS file lock on ``<out>/.zoomr-bench.lock`` for a bench's whole run.

The lock is ``flock(2)`` on an open file, so the kernel drops it when the holder's process ends, however it ends
(``kill -9`` and power loss included): no stale lock is ever left to clear by hand, and a ``--resume`` after
the holder died takes it as usual. Beside it, ``.zoomr-bench.holder.json`` (written atomically, after the lock
is taken) names the holder: pid, host, start time and command, which a refused run prints.

Sources: ``flock(2)`` (Linux man-pages; BSD semantics: the lock belongs to the open file description, so two
opens in one process exclude each other too), the lock-file-plus-holder pattern of SQLite's and git's lock
files. On Linux NFS ``flock`` is carried by NFS byte-range locks (since 2.6.12), which is why the holder names
its host. Platforms without :mod:`fcntl` (Windows), and file systems that refuse locks (``ENOLCK``), run
without the lock: :attr:`FolderLock.note` says so and the bench shows it as a warning.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from zoomr.errors import UserError

from zoomr.evaluation.atomic import write_atomic

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

LOCK_NAME = ".zoomr-bench.lock"
HOLDER_NAME = ".zoomr-bench.holder.json"
HOLDER_WAIT_S = 1.0     # a holder writes its file right after taking the lock: how long a refused run waits for it
COMMAND_CHARS = 160     # of the holder's command line in a refusal (the file keeps all of it)


class FolderBusy(UserError):
    """Another process holds the folder's lock (exit 2 in the CLI).

    Attributes:
        folder: the bench folder; holder: the holder's {"pid", "host", "started", "command"}, or None when it
            has not written them (yet).
    """

    def __init__(self, folder: Path, holder: dict | None):
        self.folder, self.holder = folder, holder
        if holder is None:
            who = "another process (it has not recorded its pid yet)"
        else:
            command = str(holder.get("command", ""))
            if len(command) > COMMAND_CHARS:
                command = command[:COMMAND_CHARS - 1] + "…"
            who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')} ({command})"
        super().__init__(f"--out {folder}: another bench is writing there: {who}; wait for it to end (a --resume "
                         "then finishes its cells), or choose another --out")


class FolderLock:
    """The exclusive lock of one bench folder, held from :meth:`acquire` to :meth:`release`.

    Attributes:
        folder: the folder; enforced: False where no OS lock could be taken (then ``note`` says why).
        note: None, or the one line to show when the folder is not locked.
    """

    def __init__(self, folder: Path, fd: int | None, note: str | None = None):
        self.folder, self.note = folder, note
        self._fd = fd

    @property
    def enforced(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(cls, folder: Path, command: list[str] | None = None) -> "FolderLock":
        """Lock ``folder`` (an existing folder) for this process, without waiting, and record who holds it.

        Args:
            command: the holder's command line for the holder file (default ``sys.argv``).
        Returns:
            the held lock (``enforced`` False, with a ``note``, where the OS offers no lock).
        Raises:
            FolderBusy: another process (or another bench of this one) holds it.
            OSError: the lock file cannot be created.
        """
        if fcntl is None:
            return cls(folder, None, f"--out {folder}: this platform has no fcntl.flock, so nothing stops a second "
                                     "bench writing into this folder at the same time")
        path = folder / LOCK_NAME
        while True:
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise FolderBusy(folder, _wait_for_holder(folder)) from None
                return cls(folder, None, f"--out {folder}: the file system refuses file locks "
                                         f"({e.strerror or e}), so nothing stops a second bench writing here")
            # a holder that released unlinked the file we opened: our lock is then on a file nobody else sees
            if _same_file(fd, path):
                break
            os.close(fd)
        lock = cls(folder, fd)
        try:
            write_atomic(folder / HOLDER_NAME, json.dumps(holder_info(command), indent=1) + "\n")
        except BaseException:
            lock.release()
            raise
        return lock

    def release(self) -> None:
        """Remove the lock and holder files and drop the lock (once; later calls do nothing).

        The files go while the lock is still held, so no process that takes the lock later finds another's
        holder file, and a run that made the folder and wrote nothing can remove it again.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            for name in (HOLDER_NAME, LOCK_NAME):
                with contextlib.suppress(OSError):
                    (self.folder / name).unlink()
        finally:
            os.close(fd)   # drops the flock

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder_info(command: list[str] | None = None) -> dict:
    """This process as a lock holder: {"pid", "host", "started" (local time, ISO 8601 to the second), "command"}."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.argv if command is None else command)}


def read_holder(folder: Path) -> dict | None:
    """The holder recorded in ``folder``, or None (no file, or not ours)."""
    try:
        info = json.loads((folder / HOLDER_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) and "pid" in info else None


def _wait_for_holder(folder: Path) -> dict | None:
    """The holder of a lock another process holds: its file is written just after the lock is taken, so it may
    be missing for a moment, or still name a holder that died (a ``kill -9`` leaves the file, not the lock)."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        info = read_holder(folder)
        if info is not None and not _dead_here(info):
            return info
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _dead_here(info: dict) -> bool:
    """True for a holder on this host whose process no longer exists (its file outlived it)."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:   # alive, another user's
        return False
    return False


def _open_lock_file(path: Path) -> int:
    """The lock file, created if missing; read-only when another user's run left it behind (flock needs no
    write access, and the folder's own permissions say whether this run may write there)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
