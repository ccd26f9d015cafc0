"""What a result was produced with: the model's bytes, zoomr's version and commit, the libraries that computed it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

from zoomr.backends.fingerprint import model_fingerprint
from zoomr.backends.models import ModelNotFound, resolve_model

# distributions whose version changes numbers a bench prints (matplotlib only draws them)
PACKAGES = ("torch", "llama-cpp-python", "math-verify", "numpy", "gguf", "matplotlib")
GIT_TIMEOUT_S = 5


def git_state(source: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, dirty) of the git checkout that tracks the file ``source``, or (None, None).

    A wheel installed into a virtualenv that happens to sit inside some other repository must not report that
    repository's commit, so the commit counts only when git tracks ``source`` itself. Dirty means tracked files
    differ from HEAD (untracked files ignored, as ``git describe --dirty`` does). Any git failure, a missing git or a
    hang beyond 5 s gives (None, None).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # a caller's GIT_DIR must not redirect us

    def git(*args: str) -> str:
        return subprocess.run(("git", *args), cwd=source.parent, env=env, capture_output=True, text=True, check=True,
                              timeout=GIT_TIMEOUT_S).stdout.strip()

    try:
        git("ls-files", "--error-unmatch", source.name)
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, dirty


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_provenance(model_path: Path | str | None) -> dict:
    """Provenance of a run, for ``config.json``.

    Args:
        model_path: the model's local file or HF directory (``ModelSource.path``); None for the embedded default
            model. A string that names no local file or directory (e.g. a hub id) gets ``model_sha256`` None:
            nothing here downloads.
    Returns:
        ``model_path`` (str or None), ``model_sha256`` (hex or None), ``model_bytes`` (int or None),
        ``model_files`` (HF directories only, see :func:`model_fingerprint`), ``zoomr_version`` (installed
        distribution "zoomr"), ``git_commit`` and ``git_dirty`` (None unless this source is a git checkout),
        ``python``, ``platform``, and ``packages``: {distribution: version or None} for :data:`PACKAGES`.
    Raises:
        OSError: the model file exists but cannot be read.
    """
    if model_path is None:
        try:
            model_path = resolve_model(None).path
        except ModelNotFound:
            pass
    path = None if model_path is None else Path(model_path).expanduser()
    fingerprint = model_fingerprint(path) if path is not None else {"model_sha256": None, "model_bytes": None}
    commit, dirty = git_state(Path(__file__).resolve().parents[1] / "__init__.py")  # zoomr/__init__.py: tracked in any checkout
    return {
        "model_path": None if path is None else str(path),
        **fingerprint,
        "zoomr_version": _version("zoomr"),
        "git_commit": commit,
        "git_dirty": dirty,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {d: _version(d) for d in PACKAGES},
    }
