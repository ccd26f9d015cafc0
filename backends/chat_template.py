"""Rendering a model's Jinja chat template in jinja2's sandbox.

HF and llama.cpp both render templates with ``trim_blocks``/``lstrip_blocks`` and a
``raise_exception`` helper; we do the same inside ``ImmutableSandboxedEnvironment`` so a model file
cannot run code through its template, with its size, its ``range()`` loops and its ``*``/``**`` bounded,
and anything a render raises reported as one :class:`ChatTemplateError`.
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .base import Tokenizer

# Used only when a model ships no template: ChatML, the most common instruct format.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Largest chat template rendered (bytes of UTF-8). Real templates are a few KiB (tool-calling ones up to
# about 20 KiB); the limit keeps a model file's template from being an arbitrarily large program.
MAX_TEMPLATE_BYTES = 64 * 1024


class ChatTemplateError(ValueError):
    """The model's chat template failed to render (it raised, or is not valid Jinja)."""


# A template is a program from the model file: these bound what one render may spend. range() items over
# the whole render (jinja2's sandbox bounds each range() alone, not ranges nested in loops), and the
# longest string or list a ``*`` may build (a few hundred KiB of prompt is already far beyond any context).
MAX_RANGE_ITEMS = 100_000
MAX_REPEAT_ITEMS = 1 << 20


def _raise(msg: str):
    raise ChatTemplateError(f"chat template: {msg}")


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with ``*`` and ``**`` bounded (repetition length, exponent size)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT_ITEMS:
                raise ChatTemplateError(f"chat template: a repetition of {len(seq) * n} items exceeds "
                                        f"{MAX_REPEAT_ITEMS}")
        elif isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
            raise ChatTemplateError(f"chat template: {left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)


def _budgeted_range():
    left = [MAX_RANGE_ITEMS]

    def bounded_range(*args):
        r = range(*args)
        left[0] -= len(r)
        if left[0] < 0:
            raise ChatTemplateError(f"chat template: loops over range() exceed {MAX_RANGE_ITEMS} items in one render")
        return r

    return bounded_range


def _env() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["range"] = _budgeted_range()
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` ([{"role", "content"}]) in the model's own chat format.

    Falls back to ChatML when the model has no template.

    Raises:
        ChatTemplateError: the template raised or does not parse.
    """
    source = tokenizer.chat_template or CHATML
    if not isinstance(source, str):
        raise ChatTemplateError(f"chat template is a {type(source).__name__}, not text")
    if len(source.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"chat template of {len(source.encode('utf-8', 'surrogatepass'))} bytes exceeds "
                                f"the {MAX_TEMPLATE_BYTES // 1024} KiB limit")
    try:
        return _env().from_string(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text,
        )
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not render: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError) as e:
        # what a template's own expressions raise (1/0, a missing index, "a" + 1, runaway macros)
        raise ChatTemplateError(f"chat template does not render: {type(e).__name__}: {e}") from None


def encode_rendered(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """Token ids of text that is *already* a rendered chat prompt, all of it trusted markup.

    Control tokens anywhere in ``rendered`` (``<|im_start|>``) are parsed as such, and BOS is added where
    the tokenizer's configuration adds one and the text does not start with it already. Text a user
    supplied must not pass through here (its ``<|im_end|>`` would become the control token): for
    messages use :func:`zoomr.backends.chat_prompt.encode_chat`, for a problem
    :func:`zoomr.prompts.solve_prompt` (messages → template → ids).

    Args:
        rendered: the template's output text.
    Returns:
        token ids (tokens).
    """
    add_bos = not (tokenizer.bos_text and rendered.startswith(tokenizer.bos_text))
    return tokenizer.encode(rendered, add_bos=add_bos, special=True)
