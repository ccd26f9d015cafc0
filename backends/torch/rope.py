"""Rotary position embeddings (rotate-half form, HF order), with the scalings model configs name.

Source: RoFormer (Su et al., 2021); "linear" position interpolation (Chen et al., 2023);
"llama3" frequency-band scaling as in Meta's Llama 3.1 reference code; GGUF ``rope_freqs``
per-frequency divisors as llama.cpp applies them.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies, shape [head_dim // 2], float64.

    Args:
        head_dim: rotary dimension (tokens' head size).
        theta: RoPE base.
        scaling: HF ``rope_scaling`` dict or None; supported ``rope_type``/``type``: linear, llama3.
        freq_factors: optional [head_dim // 2] divisors (GGUF ``rope_freqs.weight``).
    Raises:
        ValueError: an unsupported scaling type.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    if not scaling:
        return inv
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = float(scaling.get("factor", 1.0))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")


class RotaryTable:
    """Precomputed cos/sin for positions [0, n), grown on demand.

    ``cos``/``sin`` have shape [n, head_dim] (each frequency repeated for both halves), in ``dtype``;
    ``sin`` carries the rotate-half sign (its first half negated), so :func:`apply_rotary` needs no
    negation per forward.
    """

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype, n: int = 4096):
        self.inv_freq = inv_freq
        self.device, self.dtype = device, dtype
        self._build(n)

    def _build(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float64)
        ang = torch.outer(pos, self.inv_freq)
        ang = torch.cat([ang, ang], dim=-1)
        self.cos = ang.cos().to(self.device, self.dtype)
        sin = ang.sin()
        sin[:, :ang.shape[1] // 2] *= -1
        self.sin = sin.to(self.device, self.dtype)

    def get(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (see the class) for ``positions`` (shape [T], int64): each [T, head_dim]."""
        need = int(positions.max()) + 1
        if need > self.cos.shape[0]:
            self._build(max(need, 2 * self.cos.shape[0]))
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [heads, T, head_dim] by ``cos`` and the signed ``sin`` of :class:`RotaryTable`, each
    [T, head_dim] (rotate-half convention): x·cos + (x₂, x₁)·sin, a new [heads, T, head_dim] tensor."""
    # three ops instead of six (the halves swap in one flip, the sign sits in the table): decode runs this
    # once per layer per token, on tensors so small that each op's dispatch costs more than its arithmetic
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)
