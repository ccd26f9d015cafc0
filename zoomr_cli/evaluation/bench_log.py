"""A bench's output folder: made, locked for this run alone (:mod:`zoomr.evaluation.folder_lock`) and checked
against the run before anything runs, its provenance recorded, and removed again when a refused run made it and
wrote nothing."""

from __future__ import annotations

import tempfile
from pathlib import Path

from zoomr.errors import UserError

from zoomr.evaluation.folder_lock import FolderLock
from zoomr.evaluation.records import RecordLog, read_config


def unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (the OS's words), or None when one can: a scratch file is
    created and removed, since permission bits alone miss read-only mounts and say nothing for root."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".zoomr-probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def remove_if_empty(out: Path) -> None:
    """Remove ``out`` if it holds nothing (a folder this run created and then wrote nothing to)."""
    try:
        out.rmdir()
    except OSError:
        pass


def open_log(out: Path, config: dict, resume: bool) -> tuple[RecordLog, FolderLock]:
    """Create ``out``, lock it for this run and check it against this run (settings of a resumed run must not
    change). The lock comes before the records are read: a second run on the folder stops here, before its
    first cell, however far the first has got (no record written yet included), and nothing reads or trims
    the records while another run appends to them.

    Args:
        config: this run's settings; on resume the old run's settings it lacks are added to it (in place).
    Returns:
        (the folder's record log, the held lock: the caller releases it when the run ends).
    Raises:
        zoomr.evaluation.folder_lock.FolderBusy (a UserError): another run holds the folder.
        UserError: the folder cannot be made or locked, holds records without ``resume``, or other settings.
        ValueError: a records file or config.json that is not ours.
    """
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder (bench writes records.jsonl, config.json and "
                        "plots into a folder)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None
    why = unwritable(out)
    if why is not None:
        raise UserError(f"--out {out}: cannot write there ({why})")
    try:
        lock = FolderLock.acquire(out)
    except OSError as e:
        raise UserError(f"--out {out}: cannot lock the folder ({e.strerror or e})") from None
    try:
        return _checked_log(out, config, resume), lock
    except BaseException:
        lock.release()
        raise


def _checked_log(out: Path, config: dict, resume: bool) -> RecordLog:
    """:func:`open_log`'s checks of the records and settings already in the (locked) folder."""
    cfg_path, rec_path = out / "config.json", out / "records.jsonl"
    if rec_path.exists() and rec_path.stat().st_size and not resume:
        raise UserError(f"{out} already holds bench records: add --resume, or choose another --out")
    if resume and cfg_path.exists():
        old = read_config(cfg_path)
        # a setting the old run did not have (e.g. --rescue added later) only adds cells: allowed
        diff = [k for k in config if k in old and old[k] != config[k]]
        if diff:
            raise UserError(f"--resume: settings differ from the run in {out} ({', '.join(diff)})")
        # which Ray workers ran the old cells is no setting: this run records its own (or none)
        config.update({k: v for k, v in old.items() if k not in config and k != "workers"})
    log = RecordLog(rec_path)
    if log.records and not cfg_path.exists():
        raise UserError(f"--resume: {out} holds records but no config.json, so its settings cannot be checked; "
                        "choose another --out")
    return log


def check_provenance(config: dict, now: dict) -> None:
    """Put this run's provenance (:func:`zoomr.evaluation.provenance.run_provenance`) into ``config``; a resumed
    run must use the same model file.

    Library versions and the git commit may change between a run and its resume (they are recorded, the
    newest wins); a different model under the same name would mix two models' records, so it is refused.

    Raises:
        UserError: the model's sha256 differs from the one the folder's run recorded.
    """
    old = (config.get("provenance") or {}).get("model_sha256")
    if old and now.get("model_sha256") and old != now["model_sha256"]:
        raise UserError(f"--resume: the model file differs from the run's (sha256 {now['model_sha256'][:12]}… "
                        f"vs {old[:12]}…); choose another --out")
    config["provenance"] = now
