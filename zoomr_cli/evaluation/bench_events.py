"""What a running bench reports (:func:`zoomr.bench`'s ``on_event``): plain dataclasses, in the order they happen.

The bench engine prints nothing; the CLI (``zoomr bench``) turns these into its stderr lines, progress bar,
live table and final tables, and a library caller may log or ignore them. A run emits, in order:
:class:`Info` lines (which knob applies to which policies), a :class:`Warning` if ``resume`` found no records,
:class:`Loading` at the start and end of each model load (none when every cell is recorded already),
:class:`BenchStarted`, then per batch :class:`BatchStarted` and per matched or rescue cell :class:`CellStarted`,
a :class:`CellFinished` per record written, and at the end (also after an error or Ctrl-C)
:class:`SummaryWritten`, the closing :class:`Warning` lines and :class:`BenchFinished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class BenchEvent:
    """Base of every bench event."""


@dataclass(frozen=True)
class Info(BenchEvent):
    """A line worth showing the user (e.g. ``--window 8 applies to rkv only``)."""

    text: str


@dataclass(frozen=True)
class Warning(BenchEvent):   # shadows the builtin in this module only: bench_events.Warning outside
    """A line the user should not miss (the CLI prefixes ``warning: ``); also in the result's ``warnings``."""

    text: str


@dataclass(frozen=True)
class Loading(BenchEvent):
    """A model load starts (``ended`` False) or ends (``ended`` True, also when it failed): ``what`` is
    ``"model"`` (the bench's model, or its Ray workers loading it) or ``"helper"`` (KV-Rescue's helper and
    scorer). Every start has its end."""

    what: str
    ended: bool = False


@dataclass(frozen=True)
class BenchStarted(BenchEvent):
    """Cells are about to run.

    Attributes:
        model: the loaded model in one line (``Backend.describe_model()``); None when every cell is recorded
            already and no model was loaded.
        policies: the policies compared; rescue_base: KV-Rescue's base policy (None: no rescue cells).
        dataset: the data set's name; problems: how many problems.
        out: the output folder; total: cells in all (problems × cells per problem); done: those recorded
            already (``resume``).
        records: the records so far (read only).
    """

    model: str | None
    policies: tuple[str, ...]
    rescue_base: str | None
    dataset: str
    problems: int
    out: Path
    total: int
    done: int
    records: list = field(default_factory=list)


@dataclass(frozen=True)
class BatchStarted(BenchEvent):
    """``cells`` cells start decoding, up to ``n_parallel`` sequences together."""

    cells: int
    n_parallel: int


@dataclass(frozen=True)
class CellStarted(BenchEvent):
    """One matched-budget or rescue cell starts (they run alone, after their problem's batch).

    Attributes:
        budget: tokens, or ``"matched"``.
    """

    problem_id: str
    policy: str
    budget: int | str | None


@dataclass(frozen=True)
class CellFinished(BenchEvent):
    """``record`` was appended to ``records.jsonl`` (and fsynced); ``records``: every record so far (read only)."""

    record: dict
    records: list


@dataclass(frozen=True)
class SummaryWritten(BenchEvent):
    """``summary.json`` was written: ``summary`` = {"config", "rows", and "rescue" when rescue cells ran}."""

    summary: dict


@dataclass(frozen=True)
class BenchFinished(BenchEvent):
    """The run ended (also after an error or Ctrl-C: what finished is kept).

    Attributes:
        out: the output folder; summary: ``out/summary.json``, None when no cell finished (nothing written).
        plots: the PNG files written.
    """

    out: Path
    summary: Path | None
    plots: tuple[Path, ...] = ()
