"""Rendering a model's Jinja chat template in jinja2's sandbox.

HF and llama.cpp both render templates with ``trim_blocks``/``lstrip_blocks`` and a
``raise_exception`` helper; we do the same inside ``ImmutableSandboxedEnvironment`` so a model file
cannot run code through its template.
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


class ChatTemplateError(ValueError):
    """The model's chat template failed to render (it raised, or is not valid Jinja)."""


def _raise(msg: str):
    raise ChatTemplateError(f"chat template: {msg}")


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
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
    try:
        return _env().from_string(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text,
        )
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not render: {e}") from None


def encode_rendered(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """Token ids of text that is *already* a rendered chat prompt (the output of :func:`render_chat`).

    Control tokens in ``rendered`` (``<|im_start|>``) are parsed as such, and BOS is added only when the
    text does not start with it already. No template is applied here: a raw problem or user message
    passed in would reach the model without its chat format. For a problem use
    :func:`zoomr.prompts.solve_prompt` (messages → template → ids).

    Args:
        rendered: the template's output text.
    Returns:
        token ids (tokens).
    """
    add_bos = tokenizer.bos_id is not None and not (tokenizer.bos_text and rendered.startswith(tokenizer.bos_text))
    return tokenizer.encode(rendered, add_bos=add_bos, special=True)
