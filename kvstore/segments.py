"""Segment tracker: splits generated text into regular segments R_i and summary segments S_i.

Backend-neutral (plain text and integer positions in, :class:`Segment` out; no torch), so the torch
backend's ZoomR/SumR and the llama.cpp backend's segment-level eviction share it.

Source: ZoomR paper §3.2–3.3 (delimiters ``<|begin_of_summary|>`` / ``<|end_of_summary|>``, R_i = text
before a summary since the previous one) and Appendix A.3 (semantic boundaries).

Modes (``--summaries``):
    ``model``     only summaries the model writes between the delimiters make segments. The mean key of
                  S_i averages all of its tokens, delimiters included (the paper's fine-tuned models write
                  them as two special tokens).
    ``prompted``  as ``auto``; the caller also adds :data:`SUMMARY_INSTRUCTION` to the prompt.
    ``auto``      blocks of bounded length (``min_segment``..``max_segment`` tokens) until the model writes a
                  delimiter, then delimited summaries. A block closes at the first paragraph end (``\\n\\n``)
                  once it holds ``min_segment`` tokens; when it reaches ``max_segment`` tokens without one it
                  is cut at its best edge whose length lies in [min, max]: a paragraph end, else a sentence
                  end (``. ! ? :`` followed by white space), else a line end, the latest of the strongest
                  kind, else a hard cut at ``max_segment``. So a model that writes no paragraphs (the
                  embedded one) still gets segments of a useful size, and retrieval over them works like
                  block-level retrieval (InfLLM's memory units, Quest's pages) with ZoomR's voting on top.
                  A block has no written summary: its representative key is the mean of all its keys, and
                  its stand-in (what plays the summary's part when it is voted for but not zoomed in) is
                  extractive, a few of its own first and last tokens (:func:`stand_in`).
                  Delimited summaries in ``auto``/``prompted`` are plain text split over many tokens, so
                  their mean key averages the summary's content tokens only (``Segment.content``): the
                  ~10 tokens of each delimiter would otherwise dominate a one-sentence summary's mean.
Bound: while the tracker waits for a delimited summary (``model`` mode, or ``auto``/``prompted`` after a
delimiter), the segment being written may grow to ``SUMMARY_WAIT`` × ``max_segment`` tokens (384 at 96). A
model that writes no summary, or opens ``<|begin_of_summary|>`` and never closes it, would otherwise keep
every position active for the rest of the run. When no summary has closed within that many tokens, the
segment being written is cut into blocks exactly as ``auto`` would have cut it, blocks are cut from then on
until the model writes a begin delimiter again, and one note says so on stderr (:func:`note`).
Delimiters are found on the detokenized stream, so they may span several tokens. Segment edges fall on
push edges (a forward of several tokens is never split), so a multi-token push may overshoot the bounds.
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass

BEGIN = "<|begin_of_summary|>"
END = "<|end_of_summary|>"
SUMMARY_MODES = ("model", "prompted", "auto")
BOUNDARY_SUFFIXES = (".", "!", "?", "...", ":", "\n\n", "\n\n\n")
SENTENCE_ENDS = (".", "!", "?", ":")
# edge kinds, strongest first wins when a block is cut (see :func:`edge_strength`)
PARAGRAPH_EDGE, SENTENCE_EDGE, LINE_EDGE, NO_EDGE = 3, 2, 1, 0
# a delimited summary must close within this many times the longest block (tokens), else blocks are cut
SUMMARY_WAIT = 4
SUMMARY_INSTRUCTION = (
    f"Reason in short paragraphs. After each paragraph, write a one-sentence summary of it between "
    f"{BEGIN} and {END}, then continue."
)


def note(message: str) -> None:
    """One ``zoomr: note: ...`` line on stderr, as :func:`zoomr.backends.models.model_warning` prints its
    warnings: printed, not logged, so the CLI's stderr carries it without a logging setup."""
    print(f"zoomr: note: {message}", file=sys.stderr, flush=True)


@dataclass
class _Noted:
    """Whether a tracker and its forks have printed the fallback note (one object shared by all of them)."""

    said: bool = False


def ends_at_boundary(text: str) -> bool:
    """True when ``text`` ends at a semantic boundary (ZoomR App. A.3: ``. ! ? ... : \\n\\n \\n\\n\\n``).

    Trailing spaces and tabs are ignored so ``"x. "`` counts; a lone ``\\n`` does not.
    """
    return text.rstrip(" \t").endswith(BOUNDARY_SUFFIXES)


@dataclass
class RecomputeClock:
    """When SumR/ZoomR re-select: after a token whose text ends at a semantic boundary (:func:`ends_at_boundary`,
    ZoomR App. A.3), or once ``segment_tokens`` tokens were written since the last re-selection without one.
    The second is zoomr's: text with no sentence end (a long run of equations, one a line) would otherwise keep
    every new token active until the end of the run; a block of ``--summaries auto`` is cut at that length
    anyway. A fork takes a copy (:meth:`copy`): the state is a few characters and one position.

    Attributes:
        segment_tokens: the most tokens between two re-selections (≥ 1).
        last: positions written (the sequence's end) at the last re-selection; the caller sets it to the
            prompt's end before the first.
    """

    segment_tokens: int
    last: int = 0
    tail: str = ""     # the last characters written: enough to see a boundary that spans tokens

    def due(self, text: str, end: int) -> bool:
        """Record a forward that wrote ``text`` and ended at position ``end`` (tokens written so far); True
        when the selection is to be recomputed now (and the clock restarts at ``end``)."""
        self.tail = (self.tail + text)[-8:]
        if not ends_at_boundary(self.tail) and end - self.last < self.segment_tokens:
            return False
        self.last = end
        return True

    def copy(self) -> "RecomputeClock":
        return RecomputeClock(self.segment_tokens, self.last, self.tail)


def edge_strength(left: str, right: str) -> int:
    """How good a segment edge between the text ``left`` and the next token's text ``right`` is.

    Returns :data:`PARAGRAPH_EDGE` (two or more line breaks in the white space at the edge),
    :data:`SENTENCE_EDGE` (``left`` ends with ``. ! ? :`` and white space follows, so ``3.5`` is none),
    :data:`LINE_EDGE` (one line break) or :data:`NO_EDGE`. Source: ZoomR App. A.3's boundaries, ranked.
    """
    stripped = left.rstrip()
    space = left[len(stripped):] + right[:len(right) - len(right.lstrip())]
    if space.count("\n") >= 2:
        return PARAGRAPH_EDGE
    if space and stripped.endswith(SENTENCE_ENDS):
        return SENTENCE_EDGE
    return LINE_EDGE if "\n" in space else NO_EDGE


def default_min_segment(max_segment: int) -> int:
    """The shortest block that closes at a paragraph end: ⌈max/3⌉ tokens (96 → 32)."""
    return -(-max_segment // 3)


def stand_in(regular: range) -> tuple[int, ...]:
    """Extractive stand-in of a block (``auto`` segment): its first ⌈m/2⌉ and last ⌊m/2⌋ positions.

    m = clamp(len/8, 4, 16) tokens (never more than the segment): about the 8% summary/segment
    length ratio of the paper's example (L̄_S = 20, L̄_R = 250, §3.5). The first tokens say what the
    block does, the last ones usually state its result.
    """
    n = len(regular)
    m = min(n, max(4, min(16, n // 8)))
    head = (m + 1) // 2
    return tuple(regular[:head]) + tuple(regular[n - (m - head):n])


@dataclass(frozen=True)
class Segment:
    """One closed segment of the generated text.

    Attributes:
        index: i, in order of closing (0-based).
        regular: positions of R_i (contiguous; may be empty when a summary follows a summary).
        summary: positions of S_i: the delimited summary (``kind == "model"``, delimiters included)
            or the extractive stand-in (``kind == "paragraph"``, a subset of ``regular``).
        kind: ``"model"`` (a delimited summary) or ``"paragraph"`` (a block of ``auto`` mode: a
            paragraph, a group of sentences or lines, or a hard cut).
        text: text of R_i (for display).
        content: the positions of S_i holding the summary's own text, without the delimiters' tokens;
            set only where the mean key averages them (delimited summaries in ``auto``/``prompted``).
    """

    index: int
    regular: range
    summary: tuple[int, ...]
    kind: str
    text: str = ""
    content: tuple[int, ...] | None = None

    @property
    def first(self) -> int:
        """Its first position: R_i's start, or S_i's when R_i is empty (a summary right after a summary)."""
        return self.regular.start if len(self.regular) else self.summary[0]

    @property
    def key_positions(self) -> tuple[int, ...]:
        """Positions whose mean key represents the segment: S_i for model summaries (paper §3.3; its
        content tokens when :attr:`content` is set), all of R_i for blocks (no written summary)."""
        if self.kind != "model":
            return tuple(self.regular)
        return self.content or self.summary


@dataclass(frozen=True)
class _Chunk:
    first: int   # first position
    n: int       # positions
    text: str


class _Open:
    """Text written since the last closed segment, as chunks (one per push) so chars map to positions."""

    def __init__(self, start: int, chunks: list[_Chunk] = ()):
        self.start = start
        self.chunks: list[_Chunk] = []
        self.text = ""
        self._ends: list[int] = []   # end offset of each chunk in ``text``
        for c in chunks:
            self.add(c)

    def add(self, chunk: _Chunk) -> None:
        self.chunks.append(chunk)
        self.text += chunk.text
        self._ends.append(len(self.text))

    def end(self) -> int:
        return self.chunks[-1].first + self.chunks[-1].n if self.chunks else self.start

    def find(self, needle: str, since: int) -> int:
        """Offset of ``needle`` in the text, searching only what could contain it after char ``since``."""
        return self.text.find(needle, max(0, since - len(needle) + 1))

    def text_before(self, i: int, chars: int) -> str:
        """The last ``chars`` characters of the text before chunk ``i``."""
        end = self._ends[i - 1] if i else 0
        return self.text[max(0, end - chars):end]

    def chunk_at(self, char: int) -> int:
        """Index of the chunk holding character ``char`` of :attr:`text`."""
        return min(bisect.bisect_right(self._ends, char), len(self.chunks) - 1)

    def copy(self) -> "_Open":
        """An independent open part sharing the (frozen) chunks."""
        other = _Open.__new__(_Open)
        other.start, other.chunks, other.text, other._ends = self.start, list(self.chunks), self.text, list(self._ends)
        return other

    def split(self, i: int) -> tuple[list[_Chunk], "_Open"]:
        """Chunks before index ``i``, and the rest as a new open part."""
        rest = self.chunks[i:]
        return self.chunks[:i], _Open(rest[0].first if rest else self.end(), rest)


class SegmentTracker:
    """Turns (positions, text) of generated tokens into closed :class:`Segment` objects.

    Segment edges fall on push edges: a forward of several tokens is never split.

    Args:
        mode: ``model``, ``prompted`` or ``auto`` (see the module docstring).
        max_segment: most tokens of a block before it is cut (tokens, ≥ 1); a delimited summary must close
            within :attr:`summary_bound` = ``SUMMARY_WAIT`` × max_segment tokens, else blocks are cut.
        min_segment: fewest tokens of a block that a boundary closes (tokens, 1..max_segment; default
            :func:`default_min_segment`).
    Raises:
        ValueError: unknown mode, max_segment < 1 or min_segment outside 1..max_segment.

    Use: call :meth:`push` for every forward after the prompt, in position order; read
    :attr:`segments`, :attr:`open_start`, :meth:`mode_ran` and :meth:`stats`.
    """

    def __init__(self, mode: str = "auto", max_segment: int = 96, min_segment: int | None = None):
        if mode not in SUMMARY_MODES:
            raise ValueError(f"--summaries {mode!r} unknown (choose from {', '.join(SUMMARY_MODES)})")
        if max_segment < 1:
            raise ValueError(f"max_segment must be >= 1 token, got {max_segment}")
        min_segment = default_min_segment(max_segment) if min_segment is None else min_segment
        if not 1 <= min_segment <= max_segment:
            raise ValueError(f"min_segment must be between 1 and max_segment {max_segment} tokens, got {min_segment}")
        self.mode = mode
        self.max_segment, self.min_segment = max_segment, min_segment
        self.summary_bound = SUMMARY_WAIT * max_segment
        self.segments: list[Segment] = []
        self._open: _Open | None = None
        self._regular: list[_Chunk] | None = None   # R_i while its summary is being written
        self._blocks = mode != "model"   # cutting blocks until the model writes a begin delimiter
        self._noted = _Noted()

    def copy(self) -> "SegmentTracker":
        """An independent tracker sharing the closed segments (frozen): O(segments + chunks of the open
        segment) pointers, no text copied (strings are immutable)."""
        other = SegmentTracker.__new__(SegmentTracker)
        other.mode, other._blocks = self.mode, self._blocks
        other.max_segment, other.min_segment = self.max_segment, self.min_segment
        other.summary_bound = self.summary_bound
        other._noted = self._noted   # shared: a fork of a run that printed the note does not print it again
        other.segments = list(self.segments)
        other._open = None if self._open is None else self._open.copy()
        other._regular = None if self._regular is None else list(self._regular)
        return other

    @property
    def open_start(self) -> int | None:
        """First position of the segment being written (None before the first push)."""
        if self._open is None:
            return None
        return self._regular[0].first if self._regular else self._open.start

    @property
    def in_summary(self) -> bool:
        """True while the model is writing a delimited summary."""
        return self._regular is not None

    def bounds_note(self) -> str:
        """For a policy's description: ``, segments ≤ 96 tok`` where blocks are cut, ``, a summary within
        384 tok`` in ``model`` mode."""
        if self.mode == "model":
            return f", a summary within {self.summary_bound} tok"
        return f", segments ≤ {self.max_segment} tok"

    def mode_ran(self) -> str:
        """Which segmentation produced the closed segments: ``model``, ``paragraphs``, ``paragraphs, then
        model``, ``model, then paragraphs`` (the first segment's kind first) or ``none`` (none closed yet)."""
        kinds = {s.kind for s in self.segments}
        if not kinds:
            return "none"
        if len(kinds) == 2:
            return "paragraphs, then model" if self.segments[0].kind == "paragraph" else "model, then paragraphs"
        return "model" if "model" in kinds else "paragraphs"

    def stats(self) -> dict:
        """The run's segment counts for a policy's stats (SumR and ZoomR on both backends): ``segments``
        closed, ``summaries_written`` (delimited summaries the model wrote), ``segments_cut_auto`` (blocks
        cut as in ``auto``: all segments of a model that writes none), ``summaries_mode`` (:meth:`mode_ran`)
        and ``summaries_option`` (the mode asked for)."""
        written = sum(s.kind == "model" for s in self.segments)
        return {"segments": len(self.segments), "summaries_written": written,
                "segments_cut_auto": len(self.segments) - written, "summaries_mode": self.mode_ran(),
                "summaries_option": self.mode}

    def push(self, start: int, text: str, n: int = 1) -> list[Segment]:
        """Record that positions ``[start, start + n)`` produced ``text``; return the segments it closed.

        While a summary is awaited, the segment being written stays below :attr:`summary_bound` tokens
        (plus the overshoot of a multi-token push): reaching it cuts blocks instead (:meth:`_cut_as_auto`).

        Raises:
            ValueError: ``start`` is not the position right after the previous push, or n < 1.
        """
        if n < 1:
            raise ValueError(f"push needs at least one position, got {n}")
        if self._open is None:
            self._open = _Open(start)
        elif start != self._open.end():
            raise ValueError(f"positions must be pushed in order: expected {self._open.end()}, got {start}")
        since = len(self._open.text)
        self._open.add(_Chunk(start, n, text))
        if self._blocks and self._open.find(BEGIN, since) < 0:
            return self._paragraph(self._open.text[max(0, since - 1):])
        closed = self._delimited(since)
        if self._open.end() - self.open_start >= self.summary_bound:
            closed += self._cut_as_auto()
        return closed

    def _close(self, regular: list[_Chunk], summary: tuple[int, ...] | None, kind: str,
               content: tuple[int, ...] | None = None) -> Segment:
        rng = range(regular[0].first, regular[-1].first + regular[-1].n) if regular else range(0)
        if summary is None:
            summary = stand_in(rng)
        seg = Segment(len(self.segments), rng, summary, kind, "".join(c.text for c in regular), content)
        self.segments.append(seg)
        return seg

    def _delimited(self, since: int) -> list[Segment]:
        # ``since``: chars of the open text already searched before this push (0 after a split)
        closed = []
        while True:
            op = self._open
            if self._regular is None:
                at = op.find(BEGIN, since)
                if at < 0:
                    return closed
                self._blocks = False
                self._regular, self._open = op.split(op.chunk_at(at))
                since = 0
                continue
            at = op.text.find(END, max(op.text.find(BEGIN) + len(BEGIN), since - len(END) + 1))
            if at < 0:
                return closed
            summary, self._open = op.split(op.chunk_at(at + len(END) - 1) + 1)
            positions = tuple(p for c in summary for p in range(c.first, c.first + c.n))
            content = None if self.mode == "model" else _content_positions(summary)
            closed.append(self._close(self._regular, positions, "model", content))
            self._regular, since = None, 0

    def _cut_as_auto(self) -> list[Segment]:
        """No summary closed within :attr:`summary_bound` tokens: cut the segment being written (its unclosed
        summary included) into the blocks ``auto`` would have cut, push by push, and cut blocks until the
        next begin delimiter. Says so once per tracker and its forks (:func:`note`)."""
        pending = (self._regular or []) + self._open.chunks
        self._regular, self._blocks = None, True
        self._open = _Open(pending[0].first)
        closed = []
        for chunk in pending:
            since = len(self._open.text)
            self._open.add(chunk)
            closed += self._paragraph(self._open.text[max(0, since - 1):])
        if not self._noted.said:
            self._noted.said = True
            note(f"the model wrote no summary in {self.summary_bound} tokens; segments are cut as in "
                 f"--summaries auto")
        return closed

    def _paragraph(self, recent: str) -> list[Segment]:
        # ``recent`` starts one character before this push, so a "\n\n" split over two tokens is seen
        op = self._open
        n = op.end() - op.start
        if "\n\n" in recent and op.text.strip() and n >= self.min_segment:
            done, self._open = op.split(len(op.chunks))
        elif n >= self.max_segment:
            done, self._open = op.split(self._cut(op))
        else:
            return []
        return [self._close(done, None, "paragraph")]

    def _cut(self, op: _Open) -> int:
        """Chunks of a full block to close: the latest of its strongest edges within [min, max] tokens
        (see :func:`edge_strength`), else all of it (a hard cut at max_segment)."""
        best, cut = NO_EDGE, len(op.chunks)
        for i in range(1, len(op.chunks)):
            length = op.chunks[i].first - op.start
            if not self.min_segment <= length <= self.max_segment:
                continue
            # 16 characters show the white space at the edge and what it follows
            strength = edge_strength(op.text_before(i, 16), op.chunks[i].text)
            if strength and strength >= best:
                best, cut = strength, i
        return cut


def _content_positions(chunks: list[_Chunk]) -> tuple[int, ...]:
    """Positions of a delimited summary's chunks that hold its text between the delimiters (a chunk
    counts when non-blank text of the content falls in it, so one straddling a delimiter's edge does)."""
    text = "".join(c.text for c in chunks)
    begin = text.find(BEGIN) + len(BEGIN)
    end = text.find(END, begin)
    out, offset = [], 0
    for c in chunks:
        lo, hi = max(offset, begin), min(offset + len(c.text), end)
        if hi > lo and text[lo:hi].strip():
            out.extend(range(c.first, c.first + c.n))
        offset += len(c.text)
    return tuple(out)
