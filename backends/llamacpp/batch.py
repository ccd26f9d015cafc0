"""A reusable ``llama_batch``: rows of (token, position, sequence id, wants logits)."""

from __future__ import annotations


class Batch:
    """One ``llama_batch_init`` allocation, refilled for every ``llama_decode``.

    Each row belongs to exactly one sequence id (a fork shares cells with ``seq_cp`` instead of
    tagging rows with several ids). Row ``i`` with logits requested is read back with
    ``llama_get_logits_ith(ctx, i)``.

    Args:
        capacity: most rows per decode (tokens); the context's ``n_batch``.
    Raises:
        BackendError: llama.cpp could not allocate the batch.
    """

    def __init__(self, capacity: int):
        import llama_cpp

        from zoomr.backends.base import BackendError

        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        if not self.raw.token:
            raise BackendError(f"llama_batch_init could not allocate {capacity} rows")
        self.n_tokens = 0

    def set_run(self, tokens: list[int], pos0: int, seq_id: int, all_logits: bool) -> None:
        """Rows for consecutive positions ``pos0 …`` of one sequence; logits of the last row, or of every row."""
        b, n = self.raw, len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = all_logits
        b.logits[n - 1] = True
        b.n_tokens = self.n_tokens = n

    def set_runs(self, runs: list[tuple[list[int], int, int]], all_logits: bool) -> list[int]:
        """Rows for several sequences' consecutive positions, packed in order: ``runs`` holds
        (tokens, first position, sequence id) each. Logits of every run's last row, or of every row.

        Returns:
            the row index of each run's first token (the rows of run i are ``starts[i] …``).
        """
        b, i, starts = self.raw, 0, []
        for tokens, pos0, seq_id in runs:
            starts.append(i)
            for j, t in enumerate(tokens):
                b.token[i] = t
                b.pos[i] = pos0 + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq_id
                b.logits[i] = all_logits or j == len(tokens) - 1
                i += 1
        b.n_tokens = self.n_tokens = i
        return starts

    def set_rows(self, tokens: list[int], positions: list[int], seq_ids: list[int]) -> None:
        """One row per (token, position, sequence id), logits for every row (a step of several sequences)."""
        b = self.raw
        for i, (t, p, s) in enumerate(zip(tokens, positions, seq_ids)):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = True
        b.n_tokens = self.n_tokens = len(tokens)

    def close(self) -> None:
        """Free the allocation (idempotent)."""
        import llama_cpp

        if self.raw is not None:
            llama_cpp.llama_batch_free(self.raw)
            self.raw = None
