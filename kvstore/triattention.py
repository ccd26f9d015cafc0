"""``triattention``: TriAttention — keys ranked by a trigonometric series of calibrated pre-RoPE query statistics.

Source: Mao et al. 2026, "TriAttention" (github WeianMao/triattention: ``triattention/methods/triattention.py``,
``triattention/methods/pruning_utils.py``, ``scripts/calibrate.py``, ``docs/calibration.md``; the HF path whose
numbers the paper reports, run with ``scripts/cli.py``'s defaults: per-head pruning, prompt counted in the budget,
slack trigger, normalized scores, offsets up to 65,536, mean aggregation), re-derived here:

* Calibration (once per model, :mod:`zoomr.backends.torch.calibrate`): over ordinary text, per layer ℓ, query
  head h and frequency pair f (dimensions f and f + d/2 as one complex number), the complex mean q̄ of the
  pre-RoPE query and the mean modulus E|q|; a Qwen3 query after its ``q_norm`` (what attention multiplies).
* Score of a key k at position p, seen from position t (the next token's): with k̃ = the key with its RoPE
  undone at p, φ_f = arg(q̄_f · conj k̃_f) and ω_f RoPE's inverse frequencies,
  S = mean over the 17 offsets δ ∈ {1, 2, 4, …, 65536} of Σ_f |q̄_f| |k̃_f| cos((t − p + δ) ω_f + φ_f)
  + Σ_f (E|q_f| − |q̄_f|) |k̃_f|.
* Heads combine: each query head's scores are z-scored over the candidates (population std, floored at
  1e-6), a KV head takes the max over its query group, and the mean over layers; each KV head keeps its top
  keys, and that keep set applies to the KV head in every layer (the reference's ``per_head_pruning``: not
  per layer).
* Budget: never during the prompt; once B + 128 positions are attended on a decode step the cache is cut to B
  (the reference's slack trigger, ``use_slack_trigger``: no step-length schedule). The prompt is pinned and
  counts in B: its positions are kept, the other B − P are chosen by score. Positions are never shifted.

How it is computed here (same value up to rounding): the reference undoes each key's RoPE at p and then turns
it by (t − p + δ); the two rotations compose into one by t + δ, so
S = Re Σ_f q̄_f c_f e^{i t ω_f} conj(k_f) + Σ_f (E|q_f| − |q̄_f|) |k_f| on the *stored* (rotated) key k, with
c_f = mean_δ e^{i δ ω_f}: one [G, d] × [d, C] product per KV head against a "virtual query" rotated to t, and no
key positions needed at all. The RoPE inversion itself (:func:`unrotate`) is what calibration applies to the
queries it captures.

Deviations kept:

* The reference adds uniform noise of 1e-6 (seeded) to the z-scores to break ties; here ties go by
  ``torch.topk``'s order. The noise only reorders keys whose z-scores agree to 1e-6.
* The reference weights every term by the square of the RoPE's attention scaling (YaRN's mscale); the RoPEs
  zoomr runs (plain, linear, llama3) have none, so the factor is 1 and is left out.
* A prompt of P ≥ B tokens: the reference's ``decode_budget == 0`` branch keeps the prompt's first B positions
  and nothing else, which is what happens here (pinned = the first min(P, B) positions).
* On llama.cpp one selection serves every layer and KV head (``--selection shared``: the mean of the per-KV-head
  scores over KV heads too), as for the other score-ranked policies there; the newest position is always kept
  (:attr:`TriAttentionPolicy.keep_last`: llama.cpp takes a sequence's next token only right after its last cell);
  a prompt longer than the cells a sequence may hold is prefilled in chunks and cut when it fills them
  (:attr:`TriAttentionPolicy.prefill_cap`), the reference never compressing at prefill.
* Calibration: the reference's ``scripts/calibrate.py`` hooks ``q_proj``'s output, so a Qwen3 query is taken
  before its ``q_norm``; here it is taken after, as attention sees it (the issue's summary says so). Its text is
  zoomr's own shipped source files, the reference's docs naming source code as good calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .knobs import PolicyConfig, budget_knob, knob, selection_knob
from .policy import LayerView, ForwardInfo, ScoredPolicy, keep_top

OFFSETS = tuple(2 ** i for i in range(17))   # δ: 1, 2, 4, …, 65536 (the reference's offset_max_length 65536)
BUFFER = 128                                  # tokens between compressions (the reference's divide_length)
STYLES = ("half", "interleaved")              # where frequency f's pair lives: (f, f + d/2) or (2f, 2f + 1)
Z_FLOOR = 1e-6                                # the reference's floor on a head's score std


def complex_pairs(x: torch.Tensor, style: str = "half") -> torch.Tensor:
    """Real head vectors as complex numbers, one per RoPE frequency.

    Args:
        x: [..., d] float (d even).
        style: ``half`` (HF order and llama.cpp's NEOX RoPE: dimensions f, f + d/2) or ``interleaved``
            (llama.cpp's NORM RoPE, a Llama GGUF's own order: dimensions 2f, 2f + 1).
    Returns:
        [..., d / 2] complex (complex64 for float32 input, complex128 for float64).
    Raises:
        ValueError: an odd d or an unknown style.
    """
    d = x.shape[-1]
    if d % 2 or style not in STYLES:
        raise ValueError(f"complex_pairs: need an even head size and a style in {STYLES}, got {d}, {style!r}")
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if style == "half":
        return torch.complex(x[..., :d // 2], x[..., d // 2:])
    return torch.complex(x[..., 0::2], x[..., 1::2])


def unrotate(x: torch.Tensor, positions: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: each complex pair turned back by its position's angle, x · e^{−i p ω}.

    Args:
        x: [..., N, F] complex (:func:`complex_pairs` of post-RoPE vectors); positions: [N] int (tokens);
            omega: [F] RoPE inverse frequencies (radians per position; the model's, scalings applied).
    Returns:
        [..., N, F] complex in ``x``'s dtype: the pre-RoPE vectors.
    """
    angle = positions.to(torch.float64)[:, None] * omega.to(positions.device, torch.float64)[None, :]
    turn = torch.polar(torch.ones_like(angle), -angle)
    return (x.to(torch.complex128) * turn).to(x.dtype)


def offset_phasor(omega: torch.Tensor) -> torch.Tensor:
    """c_f = mean over :data:`OFFSETS` of e^{i δ ω_f}: the offsets' average as one complex factor per frequency.

    Args:
        omega: [F] (radians per position).
    Returns:
        [F] complex128.
    """
    delta = torch.tensor(OFFSETS, dtype=torch.float64)
    angle = delta[:, None] * omega.to(torch.float64)[None, :]
    return torch.polar(torch.ones_like(angle), angle).mean(dim=0)


def virtual_queries(weight: torch.Tensor, omega: torch.Tensor, t: int, style: str) -> torch.Tensor:
    """The real vectors whose dot product with a stored key is the series' position-dependent part at ``t``.

    Args:
        weight: [..., F] complex, q̄ · c (:meth:`TriAttentionPolicy.use_query_stats`).
        omega: [F]; t: the position scored from (tokens; the next token's).
        style: see :func:`complex_pairs`.
    Returns:
        [..., 2F] float32: Re and Im of q̄ c e^{i t ω} laid out as ``style`` lays out a key.
    """
    angle = float(t) * omega.to(torch.float64)
    w = weight.to(torch.complex128) * torch.polar(torch.ones_like(angle), angle)
    if style == "half":
        return torch.cat([w.real, w.imag], dim=-1).float()
    return torch.stack([w.real, w.imag], dim=-1).flatten(-2).float()


def head_scores(keys: torch.Tensor, virtual: torch.Tensor, extra: torch.Tensor, style: str) -> torch.Tensor:
    """TriAttention's score of every key for every query head of its KV group (before any normalization).

    Args:
        keys: [Hkv, C, d] post-RoPE keys (the cache's own, any float dtype).
        virtual: [Hkv, G, d] float32 from :func:`virtual_queries` (query head h of KV group h // G at row h % G).
        extra: [Hkv, G, F] float32, E|q| − |q̄| per query head and frequency.
        style: the keys' pair layout (:func:`complex_pairs`).
    Returns:
        [Hkv, G, C] float32.
    """
    k = keys.float()
    moduli = complex_pairs(k, style).abs()                                        # [Hkv, C, F]
    return torch.bmm(virtual, k.transpose(1, 2)) + torch.bmm(extra, moduli.transpose(1, 2))


def combine_heads(scores: torch.Tensor) -> torch.Tensor:
    """One layer's per-KV-head score: each query head z-scored over the candidates, then the max over the group.

    Args:
        scores: [Hkv, G, C] (:func:`head_scores`).
    Returns:
        [Hkv, C] float32.
    """
    mean = scores.mean(dim=-1, keepdim=True)
    std = scores.std(dim=-1, unbiased=False, keepdim=True).clamp_min(Z_FLOOR)
    return ((scores - mean) / std).amax(dim=1)


@dataclass(frozen=True)
class QueryStats:
    """Calibrated pre-RoPE query statistics of one model (what TriAttention scores with).

    Attributes:
        q_mean: [L, H, F] complex64, the mean complex pre-RoPE query per layer, query head and frequency.
        q_abs_mean: [L, H, F] float32, the mean of its modulus.
        omega: [F] float64, the RoPE inverse frequencies they were taken under (radians per position).
    """

    q_mean: torch.Tensor
    q_abs_mean: torch.Tensor
    omega: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(L, H, F)."""
        return tuple(self.q_mean.shape)

    @classmethod
    def placeholder(cls, n_layers: int, n_heads: int, head_dim: int) -> "QueryStats":
        """Statistics of no model (q̄ = 1, E|q| = 1, ω = 1 for every head and frequency), for a run whose sizes are
        all that is wanted (``bench --match-budget``'s simulation): when and how much the policy cuts depends on
        the lengths alone, never on the statistics."""
        F = head_dim // 2
        ones = torch.ones(n_layers, n_heads, F)
        return cls(ones.to(torch.complex64), ones, torch.ones(F, dtype=torch.float64))


@dataclass(frozen=True)
class TriAttentionConfig(PolicyConfig):
    """TriAttention's knobs. The buffer (128) and the 17 offsets are fixed, as in the reference's runs."""

    budget: int = budget_knob()
    selection: str | None = selection_knob()
    stats_file: str | None = knob(None, "triattention: query statistics file (safetensors, from zoomr calibrate "
                                  "-o FILE)", source="calibrated for the model on first use and cached")

    def build(self) -> "TriAttentionPolicy":
        return TriAttentionPolicy(self.budget, selection=self.selection, stats_file=self.stats_file)


class TriAttentionPolicy(ScoredPolicy):
    """TriAttention compression: per KV head, one keep set for every layer (see the module docstring).

    The backend hands it the model's statistics after :meth:`bind` (:meth:`use_query_stats`); the policy never
    reads a file or a model.

    Args:
        budget: B, positions kept after a compression (tokens), the prompt's included.
        selection: ``per-head`` (default: each KV head its own positions, the same in every layer) or
            ``shared`` (one set for every KV head: llama.cpp's cells).
        stats_file: a statistics file for the backend to load instead of its cached calibration (None: cached).
        buffer: positions appended between compressions (tokens; the reference's 128).
    Raises:
        ValueError: budget < 1, buffer < 1, a bad selection.

    *The prompt* is every forward before the first one-token forward (llama.cpp prefills a long prompt in
    chunks), as for R-KV's schedule (:mod:`zoomr.kvstore.schedule`).

    Attributes:
        prefill_cap: most positions a prompt forward may leave attended before it is cut all the same (a
            llama.cpp sequence's cells); None (torch): the prompt is never cut.
        keep_last: the newest positions always kept, counted in B (0, the reference's; llama.cpp's cells: 1, as
            llama.cpp accepts a sequence's next token only at the position after the last one it holds).
        prompt_tokens: P, positions the prompt wrote (tokens; 0 before it ran).
        compressions: cuts made so far.
    """

    name = "triattention"
    needs_query_stats = True   # the backends bind calibrated statistics (zoomr.backends.query_stats)

    def __init__(self, budget: int, selection: str | None = None, stats_file: str | None = None,
                 buffer: int = BUFFER):
        if budget < 1 or buffer < 1:
            raise ValueError(f"triattention: need --budget >= 1 and a buffer >= 1 (got {budget}, {buffer})")
        self.budget, self.slack, self.stats_file = budget, buffer, stats_file
        self.set_selection(selection)
        self.prefill_cap: int | None = None
        self.keep_last = 0
        self.prompt_tokens = 0
        self.compressions = 0
        self._decoding = False                   # a one-token forward has run: the prompt is over
        self._weight = self._extra = self._omega = None
        self._style = "half"
        self._pending: dict | None = None        # this forward's running sum of per-layer [Hkv, C] scores

    def use_query_stats(self, stats: QueryStats, style: str = "half") -> None:
        """Score with ``stats`` from now on (after :meth:`bind`).

        Args:
            stats: the model's statistics; [L, H, F] is regrouped to this context's layers and query heads (a
                llama.cpp context is one "layer" of L·H query heads: :mod:`zoomr.backends.llamacpp.scored`).
            style: how the cached keys lay out their RoPE pairs (:func:`complex_pairs`).
        Raises:
            ValueError: statistics of other shapes than this context's model, or an unknown style.
        """
        ctx = self.ctx
        L, H, F = stats.shape
        if L * H != ctx.n_layers * ctx.n_heads or 2 * F != ctx.head_dim or style not in STYLES:
            raise ValueError(f"triattention: statistics for {L} layers × {H} heads × {2 * F} dimensions do not fit "
                             f"this model ({ctx.n_layers} × {ctx.n_heads} × {ctx.head_dim}), or style {style!r}")
        shape = (ctx.n_layers, ctx.n_kv_heads, ctx.group, F)
        weight = stats.q_mean.to(torch.complex128) * offset_phasor(stats.omega)
        self._weight = weight.to(torch.complex64).reshape(shape).to(ctx.device)
        self._extra = (stats.q_abs_mean.float() - stats.q_mean.abs().float()).reshape(shape).to(ctx.device)
        self._omega = stats.omega.to(torch.float64).to(ctx.device)
        self._style = style

    def observe(self, view: LayerView) -> torch.Tensor | None:
        """Score this layer's candidates once B + buffer positions are attended (never in a prompt forward, unless
        it fills :attr:`prefill_cap`); the selection follows in :meth:`end_forward`.

        Raises:
            RuntimeError: no statistics were bound (:meth:`use_query_stats`).
        """
        prompt = not self._decoding and (view.start == 0 or view.n_new > 1)
        N = view.n_attended
        if N < self.budget + self.slack or (prompt and (self.prefill_cap is None or N < self.prefill_cap)):
            return None
        if self._weight is None:
            raise RuntimeError("triattention: no query statistics bound (the backend binds them with "
                               "use_query_stats; zoomr calibrate -m MODEL computes them)")
        t = view.start + view.n_new
        pin = min(view.start + view.n_new if prompt else self.prompt_tokens, self.budget - self.keep_last)
        pos = view.positions
        Hkv = pos.shape[0]
        old = (pos >= pin) & (pos < t - self.keep_last)
        if self._pending is None:
            candidates = pos[old].view(Hkv, -1)
            self._pending = {"candidates": candidates, "always": pos[~old].view(Hkv, -1), "sum": None, "layers": 0}
        if pin + self.keep_last == self.budget:   # the pinned positions fill B: nothing to choose or score
            return None
        keys = view.keys[old].view(Hkv, -1, view.keys.shape[-1])
        virtual = virtual_queries(self._weight[view.layer], self._omega, t, self._style)
        layer = combine_heads(head_scores(keys, virtual, self._extra[view.layer], self._style))
        p = self._pending
        p["sum"] = layer if p["sum"] is None else p["sum"] + layer
        p["layers"] += 1
        return None

    def end_forward(self, fwd: ForwardInfo) -> torch.Tensor | None:
        """The selection [Hkv, B] of every layer when this forward scored: the pinned prompt (and the
        :attr:`keep_last` newest) plus each KV head's top others by the mean over layers (``shared``: also over KV
        heads); None otherwise."""
        if not self._decoding and (fwd.start == 0 or len(fwd.token_ids) > 1):
            self.prompt_tokens = fwd.end
        else:
            self._decoding = True
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self.compressions += 1
        candidates, always = pending["candidates"], pending["always"]
        k = self.budget - always.shape[1]
        if k == 0:
            return always.sort(dim=1).values
        votes = pending["sum"] / pending["layers"]
        if self.selection == "per-head":
            return keep_top(votes, candidates, k, always)
        keep = keep_top(votes.mean(dim=0, keepdim=True), candidates[:1], k, always[:1])
        return keep.expand(candidates.shape[0], -1)

    def stats(self) -> dict:
        """``compressions``: cuts made so far."""
        return {"compressions": self.compressions}

    def state_tensors(self) -> list[torch.Tensor]:
        """The statistics as scored with, on the compute device (the same for every sequence of a model)."""
        return [t for t in (self._weight, self._extra, self._omega) if t is not None]

    def fork(self, ctx):
        """Shares the statistics (never written): a shallow copy."""
        return self._fork_shallow(ctx)

    def describe(self) -> str:
        return f"triattention(B={self.budget}, buffer={self.slack}, offsets={len(OFFSETS)}{self.describe_selection()})"
