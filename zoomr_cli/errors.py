"""The error type of bad input, shared by the library and the CLI (which prints it as one line, exit 2)."""


class UserError(ValueError):
    """Bad input from the user (a flag, a file, a model name): one line, no traceback, exit code 2 in the CLI."""


def check_text(text: str, where: str) -> str:
    """``text`` itself when it can be written as UTF-8, for user text that did not come from a UTF-8 decode.

    Python keeps the bytes of a command-line argument that are not UTF-8 as lone surrogates
    (``surrogateescape``), and a JSON ``"\\ud800"`` escape decodes to one: such a string fails later, deep in
    tokenization or when a record is written, so it is refused where it enters.

    Args:
        text: the user's text; ``where`` names its origin in the message (``-p``, ``--system``, a file).
    Raises:
        UserError: ``{where}: not valid UTF-8 (byte N)`` for undecodable argument bytes (N counts bytes),
            ``{where}: contains an unpaired surrogate U+XXXX at character N`` otherwise.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        first = e.start
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise UserError(f"{where}: contains an unpaired surrogate U+{ord(text[first]):04X} at character {first}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not valid UTF-8 (byte {e.start})") from None
    # escaped bytes that happen to form valid UTF-8 once joined: still not what was typed as text
    raise UserError(f"{where}: not valid UTF-8 (byte {len(text[:first].encode('utf-8'))})")
