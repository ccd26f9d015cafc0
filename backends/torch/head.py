"""An LM head whose most likely logits are exact while the vocabulary-wide matmul stays quantized.

A bf16-activation int4 kernel rounds every weight it reads to bf16 (8 significant bits) and its output logits
to bf16 as well: a logit of 20 is then known to ±0.06. That is what costs the quantized CPU path its agreement
with llama.cpp at the head (measured on SmolLM2-135M over 512 teacher-forced tokens: mean KL 0.0035 nats with
the head's bf16 logits, 0.0030 with an fp32 head over the same int4 body). Decoding only looks at the top of
the distribution (greedy, top-k, top-p), so :class:`ExactTopHead` runs the quantized head over the whole
vocabulary, then recomputes the ``k`` largest logits of every row in fp32 from the file's own rows (exact
``code · scale + zero`` values, ggml's dequantization): those ``k`` are the fp32 head's logits, the tail keeps
the kernel's rounding. Its cost is one top-k and a [k, hidden] gather per row (tens of µs a token).
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

    takes_fp32 = True  # the decoder hands it the fp32 normalized hidden state, not the compute-dtype copy

    def __init__(self, fast: Linear, table: QuantEmbedding, k: int, dtype: torch.dtype, shares_table: bool):
        if k < 1:
            raise ValueError(f"exact head logits: k must be at least 1, not {k}")
        self.fast, self.table, self.k, self.dtype = fast, table, k, dtype
        self.shares_table = shares_table
        self.kind = f"{fast.kind}, top-{k} exact"

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] float32 → [T, vocab] float32 logits; per row the ``k`` largest are fp32-exact."""
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
