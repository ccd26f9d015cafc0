"""KV-Rescue's degeneration detector as the paper states it (``--detector paper``).

Source: KV-Rescue (Cheong et al., arXiv:2608.15797), "Online degeneration detection" and "Implementation
details": a base candidate is dropped while it is generated when

* its mean predictive entropy over the last 12 tokens exceeds τ_ent = 7.0 nats, once a 24-token guard has
  passed (``"entropy"``); or
* the minimum gzip compression ratio over a sliding window of w_cmp = 800 characters falls below
  τ_cmp = 0.18 (``"repetition"``).

Nothing else: one constant threshold at every fill of the window, no cycle rule, no reading of the committed
steps. Where the paper is silent this follows the reading zoomr's own detector makes
(:mod:`zoomr.rescue.degeneration`): the window is the candidate's own text, its last ``gzip_window``
characters (all of it while shorter), its ratio is gzip level 9 bytes / UTF-8 bytes, and entropy is of the
raw next-token distribution (nats). A gzip stream is never under 20 bytes, so no text under 112 ASCII
characters is aborted for repetition (20 / 112 < 0.18).

No deviation from the paper is kept (its defaults, its two tests). What differs from ``--detector zoomr``
(the calibrated default): a short step that repeats itself legitimately (a small table, a list of equations) is
judged by 0.18 as if it filled the window, which aborted some of those steps in zoomr's calibration
(``benchmarks/detector_calibration.py``, variant ``before``); and loops an 800-character window cannot see (a
cycle over 400 characters, a count, a loop across steps) are not caught.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from zoomr.rescue.degeneration import DetectorConfig, Signals, entropy_nats, gzip_ratio

PAPER = DetectorConfig(name="paper")


class PaperDetector:
    """Reads one candidate token by token, as :class:`zoomr.rescue.degeneration.DegenerationDetector` does.

    Args:
        config: thresholds (validated here); ``repeat_chars``, ``max_copies`` and ``step_copies`` are not read.
        history, step_end: accepted for the shared interface and not read (the paper's detector sees only
            the candidate).
    Raises:
        ValueError: see :meth:`DetectorConfig.validate`.
    """

    name = "paper"

    def __init__(self, config: DetectorConfig = PAPER, history: str = "", step_end: str = "\n\n"):
        self.config = config.validate()
        self._entropies: deque[float] = deque(maxlen=config.entropy_window)
        self._text = ""
        self.signals = Signals()

    def push(self, text: str, logits: np.ndarray) -> Signals:
        """Add a token: ``text`` it completed (may be empty), ``logits`` [vocab] it was sampled from.

        Returns the updated :class:`Signals` (``repeat_chars``, ``period``, ``copies`` and ``step_copies``
        stay 0); ``abort`` is set once a threshold is crossed."""
        return self.observe(text, entropy_nats(logits))

    def observe(self, text: str, entropy: float) -> Signals:
        """:meth:`push` with the token's entropy already computed (nats)."""
        c, s = self.config, self.signals
        s.tokens += 1
        s.entropy = entropy
        self._entropies.append(entropy)
        s.mean_entropy = sum(self._entropies) / len(self._entropies)
        if text:
            self._text = (self._text + text)[-c.gzip_window:]
            s.gzip_ratio = gzip_ratio(self._text)
            s.min_gzip_ratio = min(s.min_gzip_ratio, s.gzip_ratio)
            s.gzip_threshold = c.min_gzip_ratio
        if s.abort is None:
            if s.tokens >= c.entropy_guard and s.mean_entropy > c.max_entropy:
                s.abort = "entropy"
            elif s.min_gzip_ratio < c.min_gzip_ratio:
                s.abort = "repetition"
        return s
