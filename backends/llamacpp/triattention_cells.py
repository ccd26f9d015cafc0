"""TriAttention on llama.cpp cells: the score-ranked cells (:mod:`zoomr.backends.llamacpp.scored`) with the
model's calibrated query statistics and the layout of llama.cpp's keys.

The policy is the torch backend's :class:`zoomr.kvstore.triattention.TriAttentionPolicy` in its ``shared``
selection, bound to one "layer" of ``n_layer × n_head_kv`` KV heads like the other score-ranked policies; its
statistics ([L, H, F]) are regrouped to that layer's L·H query heads (layer l's head h at row l·H + h, as
:func:`zoomr.backends.llamacpp.scored.heads_first` orders the captured rows). It reads the keys the cells already
shadow, never the queries (TriAttention's queries are the calibrated ones). The newest position is always kept
(counted in B; the reference may drop it): llama.cpp accepts a sequence's next token only at the position right
after the last cell it holds.

The keys llama.cpp hands out are in llama.cpp's own head layout: a Llama GGUF's Q/K rows are permuted for its
NORM RoPE, which pairs dimensions (2f, 2f + 1); Qwen2/Qwen3 run the NEOX RoPE on HF's layout, pairs (f, f + d/2).
:func:`rope_style` reads which one from the model (``llama_model_rope_type``), so a frequency's pair is read where
llama.cpp rotated it; the statistics are per frequency and fit both layouts.
"""

from __future__ import annotations

from zoomr.kvstore.knobs import PolicyConfig
from zoomr.kvstore.triattention import QueryStats

from .scored import PREFILL_ROOM, ScoredCells


class TriAttentionCells(ScoredCells):
    """One sequence's TriAttention on llama.cpp (see the module docstring).

    Args:
        config: a :class:`zoomr.kvstore.triattention.TriAttentionConfig` (``selection`` None or ``shared``).
        room: cells beyond the policy's bound while a prompt is prefilled (tokens); a prompt that fills
            ``bound + room`` cells is cut then (:attr:`zoomr.kvstore.triattention.TriAttentionPolicy.prefill_cap`).
    Raises:
        ValueError: ``--selection per-head``, or knobs the policy refuses.
    """

    needs_query_stats = True   # the engine hands over the model's statistics after bind()

    def __init__(self, config: PolicyConfig, room: int = PREFILL_ROOM):
        super().__init__(config, room)
        self.policy.prefill_cap = self.cap
        self.policy.keep_last = 1   # llama.cpp takes a sequence's next token only right after its last cell

    def use_query_stats(self, stats: QueryStats, style: str) -> None:
        """Score with ``stats``; ``style`` is how llama.cpp lays out this model's RoPE pairs (:func:`rope_style`).
        After :meth:`bind`."""
        self.policy.use_query_stats(stats, style)


def rope_style(model) -> str:
    """How llama.cpp's rotated keys of ``model`` (a ``llama_model*``) pair their dimensions: ``interleaved`` for
    its NORM RoPE (Llama), ``half`` for NEOX (Qwen2, Qwen3).

    Raises:
        ValueError: another RoPE type (none, multi-section, vision), which TriAttention's statistics do not fit.
    """
    import llama_cpp

    kind = llama_cpp.llama_model_rope_type(model)
    if kind == llama_cpp.LLAMA_ROPE_TYPE_NORM:
        return "interleaved"
    if kind == llama_cpp.LLAMA_ROPE_TYPE_NEOX:
        return "half"
    raise ValueError(f"--policy triattention: this model's llama.cpp RoPE type is {kind}, not the plain (NORM) or "
                     "NEOX rotation its statistics describe")
