"""The degeneration detectors of KV-Rescue, by name: the one table ``--detector`` chooses from.

* ``zoomr`` (default): :class:`zoomr.rescue.degeneration.DegenerationDetector`, the paper's two signals with
  a gzip threshold that scales with the window's fill and zoomr's cycle rules, calibrated to abort none of
  7,097 real GSM8K/MATH500 steps (``benchmarks/detector_calibration.py``).
* ``paper``: :class:`zoomr.rescue.paper_detector.PaperDetector`, KV-Rescue (arXiv:2608.15797) as stated:
  mean entropy > 7.0 over 12 tokens after a 24-token guard, or minimum gzip ratio < 0.18 over 800 characters.

Both take ``(config, history=, step_end=)`` and offer ``push``, ``observe`` and ``signals``; the config's
``name`` (:class:`zoomr.rescue.degeneration.DetectorConfig`) says which one a run builds and its records name.
"""

from __future__ import annotations

from .degeneration import DegenerationDetector, DetectorConfig
from .paper_detector import PaperDetector

DETECTORS = {"zoomr": DegenerationDetector, "paper": PaperDetector}


def check_detector(name: str) -> str:
    """``name`` when it is a detector of :data:`DETECTORS`.

    Raises:
        ValueError: any other name (one line naming ``--detector`` and the choices).
    """
    if name not in DETECTORS:
        raise ValueError(f"--detector {name!r} unknown (choose from {', '.join(DETECTORS)})")
    return name


def make_detector(config: DetectorConfig, history: str = "", step_end: str = "\n\n"):
    """A fresh detector of the kind ``config.name`` names, for one candidate.

    Args:
        config: thresholds and name; history: the committed trajectory's text before the candidate (read by
            ``zoomr`` only); step_end: the text that ends a step.
    Raises:
        ValueError: an unknown name (:func:`check_detector`) or bad thresholds (``DetectorConfig.validate``).
    """
    return DETECTORS[check_detector(config.name)](config, history=history, step_end=step_end)
