"""``--help`` in llama.cpp's style: ``-n, --n-predict N`` instead of Typer's ``<int>`` type tags.

Typer names every value by its Python type (``<str>``, ``<int>``, ``<bool>`` even for flags). Here each
option gets a metavar once, after Typer has built the click command: numbers are ``N`` (llama.cpp's
word), text is the option's name in capitals (argparse's habit: ``--model MODEL``), flags get none.
"""

from __future__ import annotations

# text options whose value is a place on disk, named for what it is rather than after the option
PATHS = {"json_path": "PATH", "out_dir": "DIR", "prompt_file": "FILE"}


def metavar(param) -> str:
    """The word shown after one option (or as one argument's name) in ``--help``; "" for flags."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    # Typer >= 0.2x keeps the annotation (list[int] for a repeatable option); older ones a click type
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    element = getattr(annotation, "__args__", (annotation,))[0]
    if element in (int, float) or getattr(getattr(param, "type", None), "name", None) in ("integer", "float"):
        return "N"
    return PATHS.get(param.name, param.name.upper())


def plain_metavars(command) -> None:
    """Give every parameter of ``command`` and its subcommands a metavar (in place) unless it has one.

    An argument's name column already shows its metavar, so its type column is emptied too. The params
    come from ``get_params``, which also creates the ``--help`` option click adds to every command.
    """
    for param in command.get_params(command.context_class(command)):
        if param.metavar is None:
            param.metavar = metavar(param)
        if param.param_type_name == "argument":
            param.display_type_rich = lambda ctx: None  # Typer would add "<str>" after the name
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)
