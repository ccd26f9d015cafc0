"""An LM head whose most likely logits are exact while the vocabulary-wide matmul stays quantized.

torch's int4/int8 weight-only kernels in bf16 take their scales in bf16 and return bf16 outputs, so every
logit is rounded to 8 significant bits: a logit of 20 is then known to ±0.06. That is what costs the quantized
CPU path agreement with llama.cpp at the head (SmolLM2-135M, 512 teacher-forced tokens, with the SwiGLU product
in bf16: mean KL 0.0035 nats with the kernel's logits, 0.0030 with an fp32 head over the same int4 body).
Decoding only looks at the top of the distribution (greedy, top-k, top-p), so :class:`ExactTopHead` runs the
quantized head over the whole vocabulary, then recomputes the ``k`` largest logits of every row in fp32 from the
file's own rows (exact ``code · scale + zero`` values, ggml's ``dequantize_row_q8_0`` / ``_q4_*``): those ``k``
are the fp32 head's logits, the tail keeps the kernel's rounding. Its cost per row is one top-k over the
vocabulary and a [k, hidden] gather and product, small beside the vocabulary-wide matmul.

Source: zoomr's own (no paper); the block layouts are ggml's (see :mod:`.quant`).
"""

from __future__ import annotations

import torch

from .quant import Linear, QuantEmbedding

# logits per row made exact: above the samplers' top-k default (20), and within it for any top-p that keeps
# fewer candidates
EXACT_TOP_K = 64
# rows re-scored at once in teacher-forced (all-position) calls: bounds the gathered [rows, k, hidden] block
_CHUNK = 64


class ExactTopHead:
    """The quantized head ``fast`` with the top ``k`` logits of every row recomputed exactly.

    Args:
        fast: the vocabulary-wide linear (any :data:`~zoomr.backends.torch.quant.Linear`) in the compute dtype.
        table: the head's [vocab, hidden] weight as exact rows (a tied model passes its embedding table).
        k: logits per row made exact (≥ 1; at least the sampler's top-k for sampling to see only exact ones).
        dtype: the compute dtype ``fast`` takes.
        shares_table: ``table`` is also the model's embedding (tied), so its bytes are counted there.
    Raises:
        ValueError: ``k`` < 1.
    """

    def __init__(self, fast: Linear, table: QuantEmbedding, k: int, dtype: torch.dtype, shares_table: bool):
        if k < 1:
            raise ValueError(f"exact head logits: k must be at least 1, not {k}")
        self.fast, self.table, self.k, self.dtype = fast, table, k, dtype
        self.shares_table = shares_table
        self.kind = f"{fast.kind}, top-{k} exact"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] float32 (the final-norm hidden states, not rounded to the compute dtype) → [T, vocab]
        float32 logits; per row the ``k`` largest (by the quantized head) are exact in fp32."""
        logits = self.fast(h.to(self.dtype)).float()
        k = min(self.k, logits.shape[-1])
        for a in range(0, h.shape[0], _CHUNK):
            rows = slice(a, a + _CHUNK)
            top = logits[rows].topk(k, dim=-1).indices                        # [t, k]
            w = self.table[top.reshape(-1)].view(*top.shape, -1)              # [t, k, hidden] fp32, exact
            exact = torch.bmm(w, h[rows].unsqueeze(-1)).squeeze(-1)           # [t, k]
            logits[rows].scatter_(-1, top, exact)
        return logits

    def nbytes(self) -> int:
        """Bytes of the quantized head, plus the exact table unless it is the (tied) embedding's own."""
        return self.fast.nbytes() + (0 if self.shares_table else self.table.nbytes())
