"""The ``zoomr`` command: Typer app, command registration and the error boundary."""

from __future__ import annotations

import functools
import importlib
import sys
from importlib import metadata
from typing import Annotated

import typer
import typer.main

from zoomr.cli.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME, fail
from zoomr.cli.help import plain_metavars
from zoomr.errors import UserError


def _click_classes(name: str) -> tuple[type, ...]:
    """Exception class ``name`` from typer's vendored click (typer >= 0.2x) and from click, where present."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if cls is not None:
            found.append(cls)
    return tuple(found)


_ABORT = _click_classes("Abort")
_CLICK_ERROR = _click_classes("ClickException")

app = typer.Typer(
    name="zoomr",
    help="Long reasoning under a fixed KV-cache budget: solve, chat and benchmark KV policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version() -> str:
    """The installed distribution's version (the source tree's ``zoomr.__version__`` when not installed)."""
    try:
        return metadata.version("zoomr")
    except metadata.PackageNotFoundError:
        from zoomr import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        print(f"zoomr {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("-V", "--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    """Long reasoning under a fixed KV-cache budget: solve, chat and benchmark KV policies."""


class Interrupted(Exception):
    """Ctrl-C inside a command, carried past Typer (which would turn a KeyboardInterrupt into a silent
    exit 130) to :func:`main`, which names it on stderr."""


def _interruptible(command):
    @functools.wraps(command)
    def run_command(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted from None
    return run_command


def _register() -> None:
    from zoomr.cli.bench import bench_command
    from zoomr.cli.chat import chat_command
    from zoomr.cli.solve import solve_command

    app.command("solve")(_interruptible(solve_command))
    app.command("chat")(_interruptible(chat_command))
    app.command("bench")(_interruptible(bench_command))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, turn failures into one stderr line and an exit code.

    Exit codes: 0 ok, 1 runtime failure, 2 bad input (usage, files, model, values), 130 Ctrl-C.
    """
    _register()
    try:
        command = typer.main.get_command(app)
        plain_metavars(command)
        rv = command(args=argv, prog_name="zoomr", standalone_mode=False)
    except _ABORT:
        print("zoomr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _CLICK_ERROR as e:
        e.show()
        return e.exit_code
    except (KeyboardInterrupt, Interrupted):
        print("zoomr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UserError, ValueError, OSError) as e:
        return fail(e, EXIT_BAD_INPUT)
    except Exception as e:  # the boundary: anything else is still one line unless ZOOMR_DEBUG
        return fail(e, EXIT_RUNTIME)
    return rv if isinstance(rv, int) else 0


def run() -> None:
    """The ``zoomr`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    run()
