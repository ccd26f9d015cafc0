"""The summarizer of the augmentation: any model zoomr loads, run greedily on its torch backend.

The paper summarizes with a larger model (Llama3-70B) given only the instruction and the paragraph
(§3.2, App. A.1); here ``--summarizer MODEL`` is any ``-m`` value, the embedded model by default.
"""

from __future__ import annotations

from zoomr.backends.base import Backend
from zoomr.backends.chat_prompt import encode_chat
from zoomr.backends.generation import GenerationStats, generate_batch
from zoomr.backends.sampling import Sampler, SamplingParams
from zoomr.errors import UserError
from zoomr.kvstore.registry import REFERENCE

from .augment import SUMMARY_PROMPT

DEFAULT_SUMMARY_TOKENS = 40


class Summarizer:
    """Summaries of single paragraphs by one loaded model.

    Args:
        model: ``-m`` value (None: the embedded model).
        max_tokens: most tokens per summary (tokens); generation also stops at the first line break.
        device, dtype: as ``zoomr solve``'s flags (torch backend).
    Raises:
        UserError: the model cannot be loaded (the loader's one-line reason, prefixed ``--summarizer``).
    """

    def __init__(self, model: str | None = None, max_tokens: int = DEFAULT_SUMMARY_TOKENS,
                 device: str = "auto", dtype: str = "auto", backend: Backend | None = None):
        if backend is None:
            from zoomr.loading import load

            try:
                backend = load(model, policy=REFERENCE, backend="torch", device=device, dtype=dtype, ctx_size=2048)
            except (ValueError, OSError) as e:
                raise UserError(f"--summarizer {model or 'default'}: {e}") from None
        self.backend = backend
        self.max_tokens = max_tokens

    def __call__(self, paragraphs: list[str]) -> list[str]:
        """Raw summary texts of ``paragraphs``, decoded together in one batch (greedy, at most
        ``max_tokens`` each; clean them with :func:`zoomr.finetune.augment.clean_summary`). A paragraph too
        long for the context gets ``""`` (rejected, then replaced by the extractive fallback)."""
        tok = self.backend.tokenizer
        prompts = [encode_chat(tok, [{"role": "user", "content": f"{SUMMARY_PROMPT}\n\n{p}"}]) for p in paragraphs]
        fits = [k for k, ids in enumerate(prompts) if len(ids) + self.max_tokens <= self.backend.n_ctx]
        out = [""] * len(paragraphs)
        if not fits:
            return out
        seqs = [self.backend.new_sequence() for _ in fits]
        stats = [GenerationStats() for _ in fits]
        try:
            logits = self.backend.prefill_batch(seqs, [prompts[k] for k in fits])
            generate_batch(self.backend, seqs, [Sampler(SamplingParams(temperature=0.0)) for _ in fits],
                           self.max_tokens, stats, logits, stop=("\n",))
        finally:
            for seq in seqs:
                self.backend.free(seq)
        for k, st in zip(fits, stats):
            out[k] = st.text
        return out
