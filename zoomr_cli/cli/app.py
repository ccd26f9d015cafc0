"""The ``zoomr`` command: Typer app, command registration and the error boundary."""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import re
import signal
import sys
from importlib import metadata
from typing import Annotated

import typer
import typer.main

from zoomr.cli.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME, debug_enabled, fail
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
_USAGE_ERROR = _click_classes("UsageError")
_NO_ARGS_HELP = _click_classes("NoArgsIsHelpError")
_NO_SUCH_OPTION = _click_classes("NoSuchOption")
_BAD_PARAMETER = _click_classes("BadParameter")
_MISSING = _click_classes("MissingParameter")


def _or_list(names: list[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _given_value(opts: list[str], argv: list[str]) -> str | None:
    """The last value ``argv`` gives to an option named ``opts`` (``-n abc``, ``--n-predict=abc``), if any."""
    found = None
    for i, arg in enumerate(argv):
        if arg in opts and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--") and arg.split("=", 1)[0] in opts and "=" in arg:
            found = arg.split("=", 1)[1]
    return found


def usage_line(e, argv: list[str]) -> str:
    """Click's usage error ``e`` as the text of one ``zoomr: error:`` line (click prints a usage block and
    ``Error: ...`` over several lines): the command, what was wrong, the flag and value it concerns, close
    matches where there are some.

    Args:
        e: a click ``UsageError`` (typer's vendored click or click itself); argv: the arguments given.
    """
    ctx = getattr(e, "ctx", None)
    # the subcommand, when there is one: "solve: ..." (the line already starts with "zoomr: error:")
    path = ctx.command_path.split(" ", 1) if ctx is not None else []
    where = f"{path[1]}: " if len(path) == 2 else ""
    if isinstance(e, _NO_SUCH_OPTION):
        near = sorted(e.possibilities or [])
        params = getattr(getattr(ctx, "command", None), "params", None)
        if params:
            # click's own matching (difflib, 3 at most) counts hidden options too (solve's -np, kept only to
            # answer bench's flag): match the visible ones the same way
            shown = [n for p in params if not getattr(p, "hidden", False) for n in getattr(p, "opts", [])
                     if n.startswith("-")]
            near = difflib.get_close_matches(e.option_name, shown)   # closest first
        return f"{where}no such option {e.option_name}" + (f"; did you mean {_or_list(near)}?" if near else "")
    group = getattr(ctx, "command", None) if ctx is not None else None
    commands = sorted(getattr(group, "commands", None) or {})
    if commands and e.message.startswith("No such command"):
        name = next((a for a in argv if not a.startswith("-")), "")
        near = difflib.get_close_matches(name, commands)
        return (f"no such command {name!r}" + (f"; did you mean {_or_list(near)}?" if near else "")
                + f" (commands: {', '.join(commands)})")
    param = getattr(e, "param", None)
    if isinstance(e, _BAD_PARAMETER) and not isinstance(e, _MISSING) and param is not None and param.opts:
        flags = "/".join(param.opts)
        value = _given_value(param.opts, argv)
        msg = e.message[:1].lower() + e.message[1:]
        return f"{where}{flags}" + (f" {value!r}" if value is not None else "") + f": {msg}"
    msg = e.format_message().rstrip(".")
    return where + msg[:1].lower() + msg[1:]

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
    if app.registered_commands:  # main() may run more than once in one process (tests)
        return
    from zoomr.cli.bench import bench_command
    from zoomr.cli.calibrate import calibrate_command
    from zoomr.cli.chat import chat_command
    from zoomr.cli.finetune import finetune_command
    from zoomr.cli.solve import solve_command

    app.command("solve")(_interruptible(solve_command))
    app.command("chat")(_interruptible(chat_command))
    app.command("bench")(_interruptible(bench_command))
    app.command("finetune")(_interruptible(finetune_command))
    app.command("calibrate")(_interruptible(calibrate_command))


@contextlib.contextmanager
def _sigterm_as_ctrl_c():
    """SIGTERM (``kill``, a job scheduler's or container's stop) ends a command the way Ctrl-C does: solve
    keeps its partial text, stats and ``--json``, bench its finished cells and the ``--resume`` hint,
    finetune saves a checkpoint; exit 130. Only in the main thread (where signal handlers can be set)."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        prev = signal.signal(signal.SIGTERM, stop)
    except ValueError:
        prev = None
    try:
        yield
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


def split_glued_flags(args: list[str]) -> list[str]:
    """``-np4`` as ``-np 4``: click reads a short flag glued to its value as ``-n p4`` (``-n`` takes a value),
    which would blame ``-n``; ``-np`` is the one multi-letter short flag, and ``p…`` is never a token count, so
    ``-np2x`` is ``-np 2x`` too (and refused as -np's value)."""
    return [x for a in args for x in (["-np", a[3:]] if re.fullmatch(r"-np.+", a) else [a])]


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the app, turn failures into one stderr line and an exit code.

    Exit codes: 0 ok, 1 runtime failure, 2 bad input (usage, files, model, values), 130 Ctrl-C or SIGTERM.
    """
    _register()
    args = split_glued_flags(sys.argv[1:] if argv is None else argv)
    try:
        command = typer.main.get_command(app)
        plain_metavars(command)
        # chat's Ctrl-C only stops an answer; a SIGTERM there must still end the process
        with _sigterm_as_ctrl_c() if args[:1] != ["chat"] else contextlib.nullcontext():
            rv = command(args=args, prog_name="zoomr", standalone_mode=False)
    except _ABORT:
        print("zoomr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _NO_ARGS_HELP as e:  # bare ``zoomr``: the help, as before
        if e.format_message().strip():  # rich help is printed to stdout as it is built: no empty line after it
            e.show()
        return e.exit_code
    except _USAGE_ERROR as e:
        if debug_enabled():
            e.show()  # click's usage block and message, above the one line
        return fail(UserError(usage_line(e, args)), EXIT_BAD_INPUT)
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
