"""The solve prompt: messages → the model's chat template → token ids (what solve, bench and rescue prefill).

:func:`solve_system` is the one place that decides the system message a solve sends on a loaded model (the
summary instruction of ``--summaries prompted``): ``zoomr.solve``, ``zoomr.run_rescue`` and the CLI all go
through it (via :func:`zoomr.solving.solve_ids`), so the library and ``zoomr solve`` prompt alike.
"""

from __future__ import annotations

from zoomr.backends.chat_prompt import encode_chat
from zoomr.kvstore.registry import policy_info
from zoomr.kvstore.segments import SUMMARY_INSTRUCTION

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def solve_messages(problem: str, system: str | None = None) -> list[dict]:
    """Chat messages for a problem: optional system message, then the problem + the boxed instruction."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": f"{problem}\n\n{INSTRUCTION}"}]


def solve_prompt(tokenizer, problem: str, system: str | None = None) -> list[int]:
    """Token ids of a problem's chat prompt, ready to prefill (what solve, bench and rescue all prefill).

    :func:`solve_messages` rendered with the model's own chat template (ChatML when it has none); control
    tokens are parsed in the template's markup only, the problem and system message stay text
    (:func:`zoomr.backends.chat_prompt.encode_chat`). The generation prompt (the assistant turn's header)
    is included.

    Args:
        tokenizer: the model's tokenizer (``backend.tokenizer``).
        problem: the problem text, as the user would type it (no template).
        system: an optional system message.
    Returns:
        token ids (tokens).
    Raises:
        zoomr.backends.chat_template.ChatTemplateError: the model's template does not render.
    """
    return encode_chat(tokenizer, solve_messages(problem, system))


def system_with_summaries(system: str | None, policy: str, summaries: str) -> str | None:
    """The system message to use: with ``--summaries prompted`` under a policy that reads ``--summaries``
    (sumr, zoomr), the instruction asking the model to write delimited summaries is appended (ZoomR §3.2:
    large models can do so when asked, without fine-tuning)."""
    if summaries != "prompted" or "summaries" not in policy_info(policy).knob_names:
        return system
    return f"{system}\n\n{SUMMARY_INSTRUCTION}" if system else SUMMARY_INSTRUCTION


def solve_system(backend, system: str | None) -> str | None:
    """The system message a solve on ``backend`` sends: :func:`system_with_summaries` for the KV policy the
    backend runs and its ``summaries`` knob (the knob as given, else the policy's default).

    The policy is read from ``backend.policy_spec`` (a :class:`zoomr.kvstore.registry.PolicySpec`: the torch
    backend's cache factory's, the llama.cpp backend's own); a backend without one (a custom cache factory,
    a test double) gets ``system`` unchanged.

    Args:
        backend: a loaded model (:func:`zoomr.load`).
        system: the caller's system message, or None.
    Returns:
        the system message to render, or None for none.
    """
    spec = getattr(backend, "policy_spec", None)
    if spec is None:
        return system
    defaults = {k.name: k.default for k in policy_info(spec.name).knobs}
    return system_with_summaries(system, spec.name, spec.knobs.get("summaries", defaults.get("summaries")))
