"""Chat prompts whose control tokens come only from the chat template.

A rendered chat prompt mixes two kinds of text: the template's own markup (``<|im_start|>user\\n``,
``<|im_end|>``), whose control tokens must become control-token ids, and user-supplied content (a problem,
a system message, chat turns, PRM step texts), which must stay text: a problem containing ``<|im_end|>``
would otherwise close the user turn and let its author write a fake assistant or system turn.

The template is rendered twice: once with the real content, once with a unique placeholder in place of
every piece of content. The placeholder rendering tells which characters are markup; the real one is the
text the model sees. Control tokens are parsed in the markup only; every stretch of text between two
control tokens (markup text and content alike) is tokenized in one plain-text call, so token boundaries
are where special-token parsing of the whole prompt would put them: a prompt whose content holds no
control-token text gets exactly the ids it always had.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import weakref

from .base import ControlToken, Tokenizer
from .chat_template import ChatTemplateError, render_chat

# private-use characters: no tokenizer control token contains them and template filters leave them alone
_OPEN, _CLOSE = "\ue000", "\ue001"
# llama.cpp strips C isspace() bytes next to an LSTRIP/RSTRIP token
_WS = " \t\n\v\f\r"


@dataclasses.dataclass(frozen=True)
class Markup:
    """Text inside a message's content that the caller wrote and wants parsed for control tokens (the PRM
    step tag ``<extra_0>``, a cut marker). A message's content is a ``str`` (all user text) or a list of
    ``str`` (user text) and :class:`Markup` pieces."""

    text: str


@dataclasses.dataclass(frozen=True)
class Piece:
    """A stretch of the rendered prompt: template (or :class:`Markup`) text, or user text."""

    text: str
    markup: bool


class ChatPrompt:
    """A rendered chat prompt as markup and user-text pieces.

    Attributes:
        tokenizer: the model's tokenizer.
        pieces: the prompt, in order; their texts joined are :attr:`text`.
    """

    def __init__(self, tokenizer: Tokenizer, pieces: list[Piece]):
        self.tokenizer = tokenizer
        self.pieces = [p for p in pieces if p.text]

    @property
    def text(self) -> str:
        """The prompt text, as the template renders it (see :func:`chat_prompt` for the one exception)."""
        return "".join(p.text for p in self.pieces)

    def cut(self, marker: str) -> ChatPrompt:
        """The prompt up to (without) the first occurrence of ``marker`` in its markup.

        Raises:
            ChatTemplateError: the markup does not contain ``marker`` (the template dropped it).
        """
        for k, p in enumerate(self.pieces):
            if p.markup and marker in p.text:
                return ChatPrompt(self.tokenizer, self.pieces[:k] + [Piece(p.text[:p.text.index(marker)], True)])
        raise ChatTemplateError(f"chat template: the rendered prompt lost the marker {marker!r}")

    def encode(self, start: int = 0) -> list[int]:
        """Token ids of the prompt from character ``start`` on (0: the whole prompt, BOS added where the
        tokenizer's configuration adds one and the template did not write it).

        Control tokens are parsed in markup only; user text never yields a control-token id.

        Args:
            start: characters of :attr:`text` to skip (those already in a KV cache; characters).
        Returns:
            token ids (tokens).
        """
        tok = self.tokenizer
        ids: list[int] = []
        plain: list[str] = []
        eat_ws = False  # the last control token swallows the whitespace after it

        def add_plain(text: str) -> None:
            nonlocal eat_ws
            if eat_ws:
                text = text.lstrip(_WS)
                eat_ws = not text
            if text:
                plain.append(text)

        def flush(rstrip: bool = False) -> None:
            text = "".join(plain)
            plain.clear()
            text = text.rstrip(_WS) if rstrip else text
            if text:
                ids.extend(tok.encode(text, add_bos=False, special=False))

        pos = 0
        for piece in self.pieces:
            skip, pos = max(0, start - pos), pos + len(piece.text)
            text = piece.text[skip:]
            if not text:
                continue
            if not piece.markup:
                add_plain(text)
                continue
            for part in _split_controls(tok, text):
                if isinstance(part, str):
                    add_plain(part)
                else:
                    flush(rstrip=part.lstrip)
                    ids.append(part.id)
                    eat_ws = part.rstrip
        flush()
        if start == 0 and tok.adds_bos and ids[:1] != [tok.bos_id]:
            ids.insert(0, tok.bos_id)
        return ids


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> ChatPrompt:
    """``messages`` ([{"role", "content"}]) in the model's chat format, markup told apart from user text.

    A template that trims a message's content (``| trim``) is followed; one that changes content in
    other ways (slices it, escapes it, branches on it) cannot be told apart from its markup: then the
    content is kept as given, in the markup the template wrote around its placeholder.

    Raises:
        ChatTemplateError: the template raised or does not parse.
    """
    held: list[str] = []
    edges: list[tuple[int | None, int | None]] = []  # per message: its first / last piece, when user text
    nonce = secrets.token_hex(8)
    texts = [t for m in messages for t in _contents(m.get("content"))]
    while any(nonce in t for t in texts if isinstance(t, str)):
        nonce = secrets.token_hex(8)

    def hold(part: str | Markup, k: int, n: int) -> str:
        if isinstance(part, Markup):
            return part.text
        held.append(part)
        first, last = edges[-1]
        edges[-1] = (len(held) - 1 if k == 0 else first, len(held) - 1 if k == n - 1 else last)
        return f"{_OPEN}{nonce}:{len(held) - 1}{_CLOSE}"

    shaped, real = [], []
    for m in messages:
        parts = [p for p in _contents(m.get("content")) if p != ""]
        if not isinstance(m.get("content"), (str, list)):
            shaped.append(m)
            real.append(m)
            continue
        edges.append((None, None))
        shaped.append({**m, "content": "".join(hold(p, k, len(parts)) for k, p in enumerate(parts))})
        real.append({**m, "content": "".join(p.text if isinstance(p, Markup) else p for p in parts)})
    skeleton = re.split(f"{_OPEN}{nonce}:(\\d+){_CLOSE}", render_chat(tokenizer, shaped, add_generation_prompt))
    truth = render_chat(tokenizer, real, add_generation_prompt)

    firsts = {f for f, _ in edges if f is not None}
    lasts = {la for _, la in edges if la is not None}
    trimmed = [(t.lstrip() if i in firsts else t) for i, t in enumerate(held)]
    trimmed = [(t.rstrip() if i in lasts else t) for i, t in enumerate(trimmed)]
    for contents in (held, trimmed):
        pieces = [Piece(s, True) if k % 2 == 0 else Piece(contents[int(s)], False) for k, s in enumerate(skeleton)]
        if "".join(p.text for p in pieces) == truth:
            return ChatPrompt(tokenizer, pieces)
    return ChatPrompt(tokenizer, [Piece(s, True) if k % 2 == 0 else Piece(held[int(s)], False)
                                  for k, s in enumerate(skeleton)])


def encode_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` in the model's chat format, control tokens only from the template.

    See :func:`chat_prompt` and :meth:`ChatPrompt.encode`.

    Returns:
        token ids (tokens).
    Raises:
        ChatTemplateError: the template raised or does not parse.
    """
    return chat_prompt(tokenizer, messages, add_generation_prompt).encode()


def _contents(content) -> list:
    if isinstance(content, str):
        return [content]
    return list(content) if isinstance(content, list) else []


_PATTERNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → its control-token regex


def _control_pattern(tok: Tokenizer) -> re.Pattern | None:
    if tok not in _PATTERNS:
        # longest first: where two control tokens could match at one place the longer wins, as in llama.cpp
        texts = sorted(tok.control_tokens, key=len, reverse=True)
        _PATTERNS[tok] = re.compile("|".join(map(re.escape, texts))) if texts else None
    return _PATTERNS[tok]


def _split_controls(tok: Tokenizer, text: str) -> list[str | ControlToken]:
    """``text`` cut into plain strings and the control tokens written in it."""
    pattern = _control_pattern(tok)
    if pattern is None:
        return [text]
    out: list[str | ControlToken] = []
    at = 0
    for m in pattern.finditer(text):
        out += [text[at:m.start()], tok.control_tokens[m.group()]]
        at = m.end()
    out.append(text[at:])
    return [p for p in out if p != ""]
