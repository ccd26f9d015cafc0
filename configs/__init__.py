"""TOML presets shipped with zoomr: model aliases (``-m NAME``) and, later, policy and bench suites."""

from __future__ import annotations

import sys
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


def load(name: str) -> dict:
    """Parsed ``configs/<name>.toml``.

    Raises:
        FileNotFoundError: no such preset file.
    """
    return tomllib.loads(resources.files(__package__).joinpath(f"{name}.toml").read_text())


def model_alias(name: str) -> str | None:
    """The hub id or file a model alias stands for (``[models.<name>] source``), or None if unknown."""
    entry = load("models").get("models", {}).get(name)
    return entry.get("source") if entry else None


def model_aliases() -> list[str]:
    """Every alias ``-m`` accepts from ``configs/models.toml``, in file order."""
    return list(load("models").get("models", {}))
