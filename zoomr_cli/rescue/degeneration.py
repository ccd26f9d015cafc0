"""Online degeneration detector for KV-Rescue base candidates (entropy and compressibility).

Source: KV-Rescue (Cheong et al., arXiv:2608.15797), "Online degeneration detection" and its
implementation details: a base candidate is aborted *while it is generated* when

* its mean predictive entropy over the last 12 tokens exceeds τ_ent = 7.0 nats (checked once a
  24-token guard has passed) — incoherent text: punctuation, symbols, mixed scripts; or
* the minimum gzip compression ratio over a sliding window of w_cmp = 800 characters drops below
  τ_cmp = 0.18 — a repetition loop (low entropy, highly compressible).

Both signals come from what decoding already produced (the logits a token was sampled from, the
text so far): no extra model forward. Entropy is of the model's raw next-token distribution
(temperature 1, before top-k/top-p), in nats. The gzip ratio is compressed bytes / UTF-8 bytes of
the window (``gzip.compress``, level 9, fixed mtime); while a candidate is shorter than the window,
the window is its whole text (short texts only compress worse, so this never aborts earlier).
"""

from __future__ import annotations

import gzip
import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds and windows of the detector (paper defaults).

    Attributes:
        max_entropy: τ_ent, abort when the windowed mean entropy exceeds it (nats).
        entropy_window: tokens averaged (tokens).
        entropy_guard: tokens generated before the entropy test applies (tokens).
        min_gzip_ratio: τ_cmp, abort when the gzip ratio of the window falls below it (compressed/raw bytes).
        gzip_window: characters in the compression window (characters).
    """

    max_entropy: float = 7.0
    entropy_window: int = 12
    entropy_guard: int = 24
    min_gzip_ratio: float = 0.18
    gzip_window: int = 800

    def validate(self) -> "DetectorConfig":
        """Return self.

        Raises:
            ValueError: a window or guard below 1, a negative or NaN threshold (one line naming the option).
        """
        if self.entropy_window < 1:
            raise ValueError(f"--entropy-window must be at least 1 token, got {self.entropy_window}")
        if self.entropy_guard < 0:
            raise ValueError(f"--entropy-guard must be >= 0 tokens, got {self.entropy_guard}")
        if self.gzip_window < 1:
            raise ValueError(f"--gzip-window must be at least 1 character, got {self.gzip_window}")
        if math.isnan(self.max_entropy) or self.max_entropy < 0:
            raise ValueError(f"--abort-entropy must be >= 0 nats, got {self.max_entropy}")
        if math.isnan(self.min_gzip_ratio) or self.min_gzip_ratio < 0:
            raise ValueError(f"--abort-gzip must be >= 0, got {self.min_gzip_ratio}")
        return self


def entropy_nats(logits: np.ndarray) -> float:
    """Entropy of softmax(``logits``) (nats); ``logits`` is [vocab], any float dtype."""
    z = logits.astype(np.float64)
    z = z - z.max()
    p = np.exp(z)
    s = p.sum()
    # H = log Σe^z − Σ p z / Σ p, without forming log p (no log 0 for underflowed tokens)
    return float(math.log(s) - (p * z).sum() / s)


def gzip_ratio(text: str) -> float:
    """gzip-compressed size / UTF-8 size of ``text`` (1.0 for empty text)."""
    raw = text.encode("utf-8")
    if not raw:
        return 1.0
    return len(gzip.compress(raw, compresslevel=9, mtime=0)) / len(raw)


@dataclass
class Signals:
    """The detector's readings after a token.

    Attributes:
        tokens: tokens seen (tokens).
        entropy: entropy of the last token's distribution (nats).
        mean_entropy: mean over the last ``entropy_window`` tokens (nats).
        gzip_ratio: ratio of the current window; min_gzip_ratio: the lowest seen so far.
        abort: None, or the reason: ``"entropy"`` (incoherent) or ``"repetition"`` (gzip).
    """

    tokens: int = 0
    entropy: float = 0.0
    mean_entropy: float = 0.0
    gzip_ratio: float = 1.0
    min_gzip_ratio: float = 1.0
    abort: str | None = None

    def as_dict(self) -> dict:
        """JSON-ready values (rounded)."""
        return {"tokens": self.tokens, "entropy": round(self.entropy, 4), "mean_entropy": round(self.mean_entropy, 4),
                "gzip_ratio": round(self.gzip_ratio, 4), "min_gzip_ratio": round(self.min_gzip_ratio, 4)}


class DegenerationDetector:
    """Reads one candidate token by token; :meth:`push` says when to abort it.

    Args:
        config: thresholds (validated here).
    Raises:
        ValueError: see :meth:`DetectorConfig.validate`.
    """

    def __init__(self, config: DetectorConfig = DetectorConfig()):
        self.config = config.validate()
        self._entropies: deque[float] = deque(maxlen=config.entropy_window)
        self._text = ""
        self.signals = Signals()

    def push(self, text: str, logits: np.ndarray) -> Signals:
        """Add a token: ``text`` it completed (may be empty), ``logits`` [vocab] it was sampled from.

        Returns the updated :class:`Signals`; ``abort`` is set once a threshold is crossed.
        """
        c, s = self.config, self.signals
        s.tokens += 1
        s.entropy = entropy_nats(logits)
        self._entropies.append(s.entropy)
        s.mean_entropy = sum(self._entropies) / len(self._entropies)
        self._text = (self._text + text)[-c.gzip_window:]
        if text:  # the window changes only when text arrives
            s.gzip_ratio = gzip_ratio(self._text)
            s.min_gzip_ratio = min(s.min_gzip_ratio, s.gzip_ratio)
        if s.tokens >= c.entropy_guard and s.mean_entropy > c.max_entropy:
            s.abort = "entropy"
        elif s.min_gzip_ratio < c.min_gzip_ratio:
            s.abort = "repetition"
        return s
