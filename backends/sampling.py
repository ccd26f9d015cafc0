"""Token sampling over float32 logits: temperature, top-k, top-p, seeded; greedy at temperature 0.

Order of the filters follows llama.cpp's default chain (top-k, then top-p, then temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens (0 = no limit).
        top_p: keep the smallest set whose probability mass reaches p (1.0 = no limit).
        seed: RNG seed; the same seed and logits give the same tokens.

    Raises:
        ValueError: from :meth:`validate` on a negative temperature or top-k, or top-p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def validate(self) -> "SamplingParams":
        """Return self, or raise ValueError naming the first invalid value."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temp must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self


class Sampler:
    """Draws token ids from logits with :class:`SamplingParams` and its own RNG stream."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def probs(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ids and their renormalized probabilities after top-k/top-p/temperature.

        Args:
            logits: shape [vocab], float.
        Returns:
            (ids [n], probs [n]) with probs summing to 1; n == 1 when greedy.
        """
        p = self.params
        if p.temperature == 0.0:
            return np.array([int(np.argmax(logits))]), np.ones(1)
        k = p.top_k if 0 < p.top_k < logits.shape[-1] else logits.shape[-1]
        ids = np.argpartition(-logits, k - 1)[:k] if k < logits.shape[-1] else np.arange(logits.shape[-1])
        z = logits[ids].astype(np.float64)
        order = np.argsort(-z, kind="stable")
        ids, z = ids[order], z[order]
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, z = ids[:keep], z[:keep]
        probs = np.exp((z - z[0]) / p.temperature)
        return ids, probs / probs.sum()

    def sample(self, logits: np.ndarray) -> int:
        """One token id drawn from ``logits`` (shape [vocab])."""
        ids, probs = self.probs(logits)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[self.rng.choice(len(ids), p=probs)])
