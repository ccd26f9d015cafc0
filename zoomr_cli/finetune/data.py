"""Training examples as token ids: user turn = the problem as ``zoomr solve`` prompts it, assistant turn =
the augmented solution; the loss covers the assistant turn only (its end-of-turn markup included).

Tokenized through zoomr's own chat-prompt code (:mod:`zoomr.backends.chat_prompt`): the problem and the
solution text stay plain text, only the template's markup and the summary delimiters become control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoomr.backends.chat_prompt import Markup, encode_chat
from zoomr.prompts import solve_messages, solve_prompt

from .augment import split_augmented

IGNORE = -100  # label of a position without loss (torch's cross_entropy ignore_index)


@dataclass(frozen=True)
class Example:
    """One tokenized example: ids [T] and labels [T] (``IGNORE`` over the prompt), T ≤ seq_len tokens."""

    ids: list[int]
    labels: list[int]


def encode_example(tokenizer, problem: str, augmented: str, seq_len: int) -> Example | None:
    """Token ids and labels of one augmented trace, cut to ``seq_len`` tokens.

    Returns:
        the example, or None when the prompt alone leaves no assistant token within ``seq_len``.
    Raises:
        ValueError: the template renders the conversation so that the prompt is not its prefix.
    """
    prompt = solve_prompt(tokenizer, problem)
    content = [Markup(t) if delim else t for t, delim in split_augmented(augmented)]
    full = encode_chat(tokenizer, solve_messages(problem) + [{"role": "assistant", "content": content}],
                       add_generation_prompt=False)
    if full[:len(prompt)] != prompt:
        raise ValueError("chat template: the conversation does not start with the solve prompt")
    if len(prompt) >= seq_len:
        return None
    labels = [IGNORE] * len(prompt) + full[len(prompt):]
    return Example(full[:seq_len], labels[:seq_len])


def collate(examples: list[Example], pad_id: int):
    """A right-padded batch: (input_ids [B, T], attention_mask [B, T], labels [B, T]) int64 tensors,
    T the longest example; padding has mask 0 and label ``IGNORE``."""
    import torch

    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.long)
    labels = torch.full((len(examples), t), IGNORE, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids[b, :n] = torch.tensor(e.ids)
        mask[b, :n] = 1
        labels[b, :n] = torch.tensor(e.labels)
    return ids, mask, labels
