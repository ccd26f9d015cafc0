"""Teacher-forced agreement of the torch backend with llama.cpp on the same GGUF file.

The reference the parity test (``tests/backends/test_parity_llamacpp.py``) and
``benchmarks/quant_fidelity.py`` share: real text (GSM8K questions and worked answers from the copy shipped
in the package), llama.cpp's logits for every position of it, and top-1 agreement / mean KL(llama.cpp ‖ torch)
in nats (:func:`zoomr.evaluation.metrics.fidelity_terms`).
"""

from __future__ import annotations

import numpy as np

from .datasets import records
from .metrics import fidelity_terms


def gsm8k_text_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of GSM8K's test questions and worked answers, in file order.

    Raises:
        ValueError: the shipped file holds fewer than ``n`` tokens.
    """
    parts = []
    for rec in records("gsm8k"):
        parts.append(f"Question: {rec['question']}\nAnswer: {rec['answer']}\n\n")
        ids = tokenizer.encode("".join(parts), add_bos=False, special=False)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the GSM8K file holds fewer than {n} tokens")


def llamacpp_logits(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's [T, vocab] float32 logits for every position of ``ids`` (one batch of at least 1,024 tokens:
    its logits move slightly with how a prompt is split into batches, so every caller splits alike)."""
    import llama_cpp

    from zoomr.backends.llamacpp.runtime import llama_defaults

    n = max(1024, len(ids))
    with llama_defaults(path):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n, n_batch=n, logits_all=True, verbose=False, seed=0)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()  # now, not in __del__ at interpreter exit, when llama.cpp's bindings are already gone


def agreement(ours, reference) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference ‖ ours) in nats) of two [T, vocab] logit arrays."""
    kl, agree = fidelity_terms(reference, ours)
    return float(agree.double().mean()), float(kl.mean())
