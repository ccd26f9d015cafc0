"""The error type of bad input, shared by the library and the CLI (which prints it as one line, exit 2)."""


class UserError(ValueError):
    """Bad input from the user (a flag, a file, a model name): one line, no traceback, exit code 2 in the CLI."""
