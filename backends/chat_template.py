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


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Tokenize a rendered prompt, adding BOS only when the text does not already start with it."""
    add_bos = tokenizer.bos_id is not None and not (tokenizer.bos_text and text.startswith(tokenizer.bos_text))
    return tokenizer.encode(text, add_bos=add_bos, special=True)
