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
the window (``gzip.compress``, level 9, fixed mtime).

This module is zoomr's calibrated detector (``--detector zoomr``, the default): it keeps both signals and
their thresholds but scales the gzip threshold with the window's fill and adds cycle rules, both below. The
paper's detector as it is stated (constant τ_cmp at every fill, nothing else) is
:class:`zoomr.rescue.paper_detector.PaperDetector` (``--detector paper``); both share one interface (``push``,
``observe``, ``signals``) and :func:`zoomr.rescue.detectors.make_detector` builds the one a config names.

While a candidate is shorter than the window (the paper does not say what happens then), the window
is its whole text and the threshold grows with the window's fill: τ_cmp · n / w_cmp for n < w_cmp
characters, τ_cmp itself once the window is full. A short text that happens to repeat itself (a
small Markdown table, a list of equations, 1 + 1 + … + 1) must therefore be far more compressible
than a full window before it counts as a loop; since a gzip stream is never under 20 bytes, nothing
shorter than :func:`shortest_gzip_abort` characters (299 at the defaults) is aborted on this
signal. Waiting for a full window instead would never catch a loop of one-character tokens
("0000…", "....") inside a 512-token step (512 characters < 800). Calibration
(``benchmarks/detector_calibration.py``): no abort of any GSM8K/MATH500 solution step (7097) nor of
the short repetitive legitimate steps built there (the constant threshold aborted some), and every
loop the constant threshold caught is still caught within the step limit, some tokens later.

An 800-character window cannot see two copies of a cycle longer than 400 characters, nor a count
(``1, 2, 3, …``, ``x = 14, x = 15, …``: every copy differs in its number). A third test, zoomr's own
(not in the paper), reads the *periodic tail* of the candidate's text: the longest suffix that equals
the text one period earlier (:func:`periodic_tail`). A ``"cycle"`` abort comes when

* the candidate holds at least ``w_cmp`` characters and its last ``repeat_chars`` = 256 characters
  or more each equal the character one period earlier: a verbatim copy of earlier text (a cycle of
  any period that fits the step); or
* with every run of digits read as one ``0`` (so ``x = 14,`` and ``x = 157,`` read alike), the text
  ends in at least ``max_copies`` = 64 back-to-back copies of a unit of two characters or more, or in
  half as many (32) that cover at least 256 characters: a count, short units (``1, 2, 3, …``) or
  lines (``a_{41} = 41``). ``1 + 1 + ⋯ + 1`` with 60 terms is kept (59 copies of `` + 1`` cover 236
  characters), 65 terms are not; a list of 30 equations of one shape is kept, 32 such lines are not;
  a rule of 80 ``=`` signs has a one-character unit and is never counted.

A sentence repeated verbatim is judged by τ_cmp itself at any fill (zoomr's own, issue 29): when the
text ends in 64 characters or more that repeat one period earlier and that unit holds a word (three
letters or more, not a LaTeX command: :func:`prose_unit`), the loop is caught as early as the constant
threshold caught it (``So the answer is 12.`` at token 71, 239 characters, not 135, 453 characters; at one
character per token a 34–66-character unit within the step, which the scaled threshold missed), while
the short legitimate steps that repeat a unit verbatim — table rows of zeros, ``\\frac{1}{2} \\cdot``
fifteen times, ``+ x`` — hold cells, numbers and commands and keep the scaled threshold.

What the detector sees (issue 29): the gzip window is the candidate's own text, since a compressible
committed step (a table) would make the next step's first tokens look like a loop. The periodic-tail tests
read the committed trajectory's tail (``history``, at most :data:`TAIL_LIMIT` characters) followed by the
candidate, so a loop that outlasts a step, or whose unit holds the step end (each copy a whole step, so a
fresh detector per candidate never saw two copies), aborts the candidate that continues it:

* ``step_copies`` = 3: the committed text ends in three copies of a unit that ends at the step end (one
  step or a cycle of steps, verbatim; :func:`step_loop`) and the candidate is writing the unit again;
* a verbatim repeat (256) or a count (32/64 copies) that the committed text already ended in, continued.

In both, the candidate must have copied 64 characters of the loop or a whole step before it is aborted:
one token that happens to continue the loop does not count, and the history alone never aborts. A step
that copies an earlier one once (a diagram drawn again) is kept: the committed text did not end in a loop.

Digits are masked for the count only: a derivation that substitutes one expression again and again
repeats itself more once its numbers are masked (up to 226 characters in the shipped MATH500/GSM8K
solutions, 151 as written), so the repeat rule reads the text as written. Calibration
(``benchmarks/detector_calibration.py``, each real step read after its solution's earlier steps): none of
the 7097 real steps nor of the 62 short repetitive legitimate ones (alone or after another) is aborted;
399 of the 400 synthetic loops are (the one missed: a cycle too long to repeat 256 characters within the
step), 100 of 100 loops across steps and 100 of 100 sentence loops of 20–66 characters at one character
per token.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import re
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DetectorConfig:
    """Thresholds and windows of the detector (paper defaults), and which detector reads them.

    Attributes:
        name: which detector runs (:data:`zoomr.rescue.detectors.DETECTORS`): ``"zoomr"``, this module's
            calibrated one (the default), or ``"paper"``, the paper's as it states it
            (:class:`zoomr.rescue.paper_detector.PaperDetector`: constant τ_cmp, no cycle rules, so it reads
            neither ``repeat_chars``, ``max_copies`` nor ``step_copies``).
        max_entropy: τ_ent, abort when the windowed mean entropy exceeds it (nats).
        entropy_window: tokens averaged (tokens).
        entropy_guard: tokens generated before the entropy test applies (tokens).
        min_gzip_ratio: τ_cmp, abort when the gzip ratio of the window falls below it (compressed/raw bytes).
        gzip_window: characters in the compression window (characters).
        repeat_chars: periodic tail that aborts once the text fills the gzip window (characters; 0: off).
        max_copies: back-to-back copies of one unit of ≥ 2 characters (digits masked) that abort; half
            as many abort when they cover 256 characters (0: off).
        step_copies: committed copies of a unit that holds the step end (whole steps, verbatim) after
            which a candidate that copies the unit once more is aborted (0: off).
    """

    max_entropy: float = 7.0
    entropy_window: int = 12
    entropy_guard: int = 24
    min_gzip_ratio: float = 0.18
    gzip_window: int = 800
    repeat_chars: int = 256
    max_copies: int = 64
    step_copies: int = 3
    name: str = "zoomr"  # last: the thresholds stay positional

    def gzip_threshold(self, chars: int) -> float:
        """The gzip ratio below which a window of ``chars`` characters is a repetition loop:
        τ_cmp · chars / w_cmp while the window is not full, τ_cmp once it is (see the module doc)."""
        return self.min_gzip_ratio * min(1.0, chars / self.gzip_window)

    def validate(self) -> "DetectorConfig":
        """Return self.

        Raises:
            ValueError: a window or guard below 1, a negative or NaN threshold, a gzip ratio above 1 (one line
                naming the option).
        """
        if self.entropy_window < 1:
            raise ValueError(f"--entropy-window must be at least 1 token, got {self.entropy_window}")
        if self.entropy_guard < 0:
            raise ValueError(f"--entropy-guard must be >= 0 tokens, got {self.entropy_guard}")
        if self.gzip_window < 1:
            raise ValueError(f"--gzip-window must be at least 1 character, got {self.gzip_window}")
        if self.repeat_chars < 0:
            raise ValueError(f"--abort-repeat must be >= 0 characters (0: off), got {self.repeat_chars}")
        if self.step_copies < 0:
            raise ValueError(f"step_copies must be >= 0 (0: off), got {self.step_copies}")
        if self.max_copies < 0 or self.max_copies == 1:
            raise ValueError(f"--abort-copies must be 0 (off) or at least 2, got {self.max_copies}")
        if math.isnan(self.max_entropy) or self.max_entropy < 0:
            raise ValueError(f"--abort-entropy must be >= 0 nats, got {self.max_entropy}")
        # a full window of ordinary text compresses to about half its bytes: a threshold above 1 would abort
        # every candidate, which no one means
        if math.isnan(self.min_gzip_ratio) or not 0 <= self.min_gzip_ratio <= 1:
            raise ValueError(f"--abort-gzip must be within [0, 1] (compressed/raw bytes; 0: off), got "
                             f"{self.min_gzip_ratio}")
        return self

    # what the paper's detector leaves unread: recorded only for the detector that reads them
    CYCLE_FIELDS = ("repeat_chars", "max_copies", "step_copies")

    def as_dict(self) -> dict:
        """JSON-ready settings: ``name`` and the thresholds the named detector reads (the paper's reads no
        cycle rule, so ``repeat_chars``, ``max_copies`` and ``step_copies`` are left out for it)."""
        d = dataclasses.asdict(self)
        if self.name == "paper":
            for key in self.CYCLE_FIELDS:
                d.pop(key)
        return d


def entropy_nats(logits: np.ndarray) -> float:
    """Entropy of softmax(``logits``) (nats); ``logits`` is [vocab], any float dtype."""
    z = logits.astype(np.float64)
    z = z - z.max()
    p = np.exp(z)
    s = p.sum()
    # H = log Σe^z − Σ p z / Σ p, without forming log p (no log 0 for underflowed tokens)
    return float(math.log(s) - (p * z).sum() / s)


TAIL_LIMIT = 1 << 15  # characters of text kept: more than any step holds, so O(step) per token
GZIP_MIN_BYTES = 20  # 10-byte header + 8-byte trailer + the shortest deflate stream (2 bytes, empty input)


def gzip_ratio(text: str) -> float:
    """gzip-compressed size / UTF-8 size of ``text`` (1.0 for empty text)."""
    raw = text.encode("utf-8")
    if not raw:
        return 1.0
    return len(gzip.compress(raw, compresslevel=9, mtime=0)) / len(raw)


def shortest_gzip_abort(config: DetectorConfig, bytes_per_char: int = 1, prose: bool = False) -> int:
    """Fewest characters a window must hold before the gzip signal can abort it (characters).

    A window of n characters and at most ``bytes_per_char`` · n UTF-8 bytes compresses to at least
    :data:`GZIP_MIN_BYTES`, so its ratio is at least 20 / (bytes_per_char · n); it can only fall under
    :meth:`DetectorConfig.gzip_threshold` from the returned n on (``bytes_per_char`` 1: ASCII text, 299
    characters at the defaults; 4: any text). ``prose``: a text that ends in a sentence repeated verbatim
    (see :func:`prose_unit`), judged by τ_cmp at any fill (112 characters at the defaults).
    """
    threshold = (lambda n: config.min_gzip_ratio) if prose else config.gzip_threshold
    n = 1
    while n < config.gzip_window and GZIP_MIN_BYTES / (bytes_per_char * n) >= threshold(n):
        n += 1
    return n


_DIGITS = re.compile(r"[0-9]+")
COUNT_CHARS = 256  # half the copies suffice when they cover this many characters (digits masked)
_PERIOD_PROBE = 64  # characters of the tail searched for earlier in the text (finds the period)


def mask_digits(piece: str, after: str) -> str:
    """``piece`` with each run of ASCII digits as one ``0``; ``after`` is the raw text before it, so a run
    that continues across the boundary (``"1"`` then ``"05"``) still reads as one ``0``."""
    out = _DIGITS.sub("0", piece)
    if piece[:1].isascii() and piece[:1].isdigit() and after[-1:].isascii() and after[-1:].isdigit():
        out = out[1:]
    return out


def periodic_tail(text: str) -> tuple[int, int]:
    """(repeated, period) of ``text``'s periodic tail, in characters: the smallest period p at which the
    last 64 characters occurred before, and how many characters at the end of ``text`` each equal the
    character p before them (so ``"ab" * 40`` gives (78, 2): 39 copies after the first). (0, 0) when
    the last 64 characters are new.

    Cost: one ``str.rfind`` over ``text`` and a walk back over the repeat, O(len(text)).
    """
    n = len(text)
    if n <= _PERIOD_PROBE:
        return 0, 0
    j = text.rfind(text[-_PERIOD_PROBE:], 0, n - 1)
    if j < 0:
        return 0, 0
    p = n - _PERIOD_PROBE - j
    i = n - 1 - p
    while i >= 0 and text[i] == text[i + p]:
        i -= 1
    return n - 1 - p - i, p


# a run of three letters or more that is not a LaTeX command (\frac, \cdot): a word of prose
_WORD = re.compile(r"(?<![\\\w])[^\W\d_]{3,}")


def prose_unit(text: str, repeated: int, period: int) -> bool:
    """Whether the unit of ``text``'s periodic tail (``repeated``, ``period`` from :func:`periodic_tail`)
    holds a word: a run of ≥ 3 letters not led by a backslash. Two copies are searched, so a word cut by
    the unit's rotation (``"e th"`` of ``" the"``) is still found.

    The legitimate steps that repeat a unit verbatim are built of cells, numbers and LaTeX commands (a
    zero table's rows, ``\\frac{1}{2} \\cdot`` fifteen times, ``+ x`` sixty times); a loop of the model
    repeats a sentence."""
    if period < 1 or repeated < 1:
        return False
    # searched from a position, not in a slice: the letter or backslash before the first one still counts
    return _WORD.search(text, max(0, len(text) - min(2 * period, repeated + period))) is not None


def step_loop(text: str, start: int, step_end: str) -> tuple[int, int, int]:
    """(copies, repeated, period) of a loop across steps, in whole steps and characters: ``text`` is the
    committed trajectory's tail up to ``start`` (which ends with ``step_end``), then the candidate.

    The unit is the committed text's last p characters, ending at the step end; p is the smallest period
    at which the step end and the candidate's first characters (64 at most) occurred before, so the unit is
    anchored at a step boundary (a unit with a shorter inner period, a sentence written four times in one
    step, is still read whole). ``copies``: back-to-back copies of the unit that end the committed text,
    when the whole candidate so far equals the text p characters before it (each of them repeats the one
    before); ``repeated`` = (copies − 1) · p + the candidate's characters. (0, 0, 0) when the committed text
    does not end with ``step_end`` or the candidate is not such a copy.

    Cost: one ``str.rfind`` over ``text`` and one comparison per copy, O(len(text)).
    """
    m, k = len(text) - start, len(step_end)
    at = start - k
    if m < 1 or k < 1 or at < 0 or text[at:start] != step_end:
        return 0, 0, 0
    probe = min(_PERIOD_PROBE, m + k)
    j = text.rfind(text[at:at + probe], 0, at - 1 + probe)
    if j < 0:
        return 0, 0, 0
    p = at - j
    if text[start:] != text[start - p:len(text) - p]:
        return 0, 0, 0
    copies, end = 1, start
    while end - 2 * p >= 0 and text[end - p:end] == text[end - 2 * p:end - p]:
        copies, end = copies + 1, end - p
    return copies, (copies - 1) * p + m, p


@dataclass
class Signals:
    """The detector's readings after a token.

    Attributes:
        tokens: tokens seen (tokens).
        entropy: entropy of the last token's distribution (nats).
        mean_entropy: mean over the last ``entropy_window`` tokens (nats).
        gzip_ratio: ratio of the current window; min_gzip_ratio: the lowest seen so far.
        gzip_threshold: what the current window's ratio is compared with (see
            :meth:`DetectorConfig.gzip_threshold`; 0 before any text).
        repeat_chars, period: the periodic tail of the text: characters equal to the one a period
            earlier, and that period (characters; see :func:`periodic_tail`).
        copies: back-to-back copies of one unit at the end of the digit-masked text (0 when its period
            is under 2 characters).
        step_copies: whole copies of a unit holding the step end that end the committed text, when the
            candidate repeats that unit from its first character (0 otherwise; see :func:`step_loop`).
        abort: None, or the reason: ``"entropy"`` (incoherent), ``"repetition"`` (gzip) or ``"cycle"``
            (periodic tail); once set it stays, with the first reason.
    """

    tokens: int = 0
    entropy: float = 0.0
    mean_entropy: float = 0.0
    gzip_ratio: float = 1.0
    min_gzip_ratio: float = 1.0
    gzip_threshold: float = 0.0
    repeat_chars: int = 0
    period: int = 0
    copies: int = 0
    step_copies: int = 0
    abort: str | None = None

    def as_dict(self) -> dict:
        """JSON-ready values (rounded)."""
        return {"tokens": self.tokens, "entropy": round(self.entropy, 4), "mean_entropy": round(self.mean_entropy, 4),
                "gzip_ratio": round(self.gzip_ratio, 4), "min_gzip_ratio": round(self.min_gzip_ratio, 4),
                "gzip_threshold": round(self.gzip_threshold, 4), "repeat_chars": self.repeat_chars,
                "period": self.period, "copies": self.copies, "step_copies": self.step_copies}


class DegenerationDetector:
    """Reads one candidate token by token; :meth:`push` says when to abort it.

    What it reads: the gzip signal, the candidate's own text (a compressible committed step, a table, must
    not make the next step's first tokens look like a loop); the periodic-tail tests (``"cycle"``), the
    committed trajectory's tail (``history``) followed by the candidate, so a loop that outlasts a step or
    whose unit holds the step end (each copy a whole step) aborts the candidate that continues it. The
    history alone never aborts: each test reads a repeat that runs up to the candidate's latest character.

    Args:
        config: thresholds (validated here).
        history: the committed trajectory's text before the candidate (its last :data:`TAIL_LIMIT`
            characters are kept; "" for a first step or a detector used on its own).
        step_end: the text that ends a step (``RescueConfig.step_end``).
    Raises:
        ValueError: see :meth:`DetectorConfig.validate`.
    """

    def __init__(self, config: DetectorConfig = DetectorConfig(), history: str = "", step_end: str = "\n\n"):
        self.config = config.validate()
        self.step_end = step_end
        self._entropies: deque[float] = deque(maxlen=config.entropy_window)
        self._text = ""    # the candidate's own text (bounded: a step is a few thousand characters)
        self._all = history[-TAIL_LIMIT:]        # committed tail + candidate
        self._masked = mask_digits(self._all, "")  # the same, digits masked
        # where the candidate begins in each (moves back as the tail is cut)
        self._start, self._mstart = len(self._all), len(self._masked)
        self.signals = Signals()

    def push(self, text: str, logits: np.ndarray) -> Signals:
        """Add a token: ``text`` it completed (may be empty), ``logits`` [vocab] it was sampled from.

        Returns the updated :class:`Signals`; ``abort`` is set once a threshold is crossed.
        """
        return self.observe(text, entropy_nats(logits))

    def observe(self, text: str, entropy: float) -> Signals:
        """:meth:`push` with the token's entropy already computed (nats), e.g. from teacher-forced
        logits or, to read the gzip signal alone, 0."""
        c, s = self.config, self.signals
        s.tokens += 1
        s.entropy = entropy
        self._entropies.append(s.entropy)
        s.mean_entropy = sum(self._entropies) / len(self._entropies)
        repetitive = cyclic = False
        if text:  # the window changes only when text arrives
            masked = self._masked + mask_digits(text, self._all)
            self._masked = masked[-TAIL_LIMIT:]
            self._mstart = max(0, self._mstart - (len(masked) - len(self._masked)))
            grown = self._all + text
            self._all = grown[-TAIL_LIMIT:]
            self._start = max(0, self._start - (len(grown) - len(self._all)))
            own = len(self._all) - self._start
            # a repeat that began in the committed text counts once the candidate has copied 64 characters
            # of it or a whole step: one token that happens to continue it does not
            copied = own >= _PERIOD_PROBE or self._all.endswith(self.step_end)
            self._text = (self._text + text)[-c.gzip_window:]
            s.gzip_ratio = gzip_ratio(self._text)
            s.min_gzip_ratio = min(s.min_gzip_ratio, s.gzip_ratio)
            s.repeat_chars, s.period = periodic_tail(self._all)
            # a sentence repeated verbatim is judged by τ_cmp at any fill: the scaled threshold is for
            # the short steps that legitimately repeat cells and numbers (see prose_unit)
            prose = s.repeat_chars >= _PERIOD_PROBE and prose_unit(self._all, s.repeat_chars, s.period)
            s.gzip_threshold = c.min_gzip_ratio if prose else c.gzip_threshold(len(self._text))
            repetitive = s.gzip_ratio < s.gzip_threshold
            # a short step may repeat itself verbatim (a zero table's rows), a step may copy an earlier one
            # (a diagram drawn again): the repeat rule waits for a full window of the candidate, unless the
            # committed text already ended in such a repeat (a loop that outlasts a step)
            verbatim = c.repeat_chars and s.repeat_chars >= c.repeat_chars and (
                own >= c.gzip_window or (copied and s.repeat_chars - own >= c.repeat_chars))
            repeated, period = periodic_tail(self._masked)
            s.copies = repeated // period + 1 if period >= 2 else 0
            own_masked = len(self._masked) - self._mstart
            counted = c.max_copies and (s.copies >= c.max_copies or (
                2 * s.copies >= c.max_copies and repeated >= COUNT_CHARS)) and (
                repeated <= own_masked or (copied and repeated - own_masked >= COUNT_CHARS))
            s.step_copies, step_repeat, step_period = step_loop(self._all, self._start, self.step_end)
            looping_steps = c.step_copies and s.step_copies >= c.step_copies and copied
            if looping_steps:
                s.repeat_chars, s.period = step_repeat, step_period
            cyclic = looping_steps or verbatim or counted
        if s.abort is None:
            if s.tokens >= c.entropy_guard and s.mean_entropy > c.max_entropy:
                s.abort = "entropy"
            elif repetitive:
                s.abort = "repetition"
            elif cyclic:
                s.abort = "cycle"
        return s
