"""KV-cache accounting shared by every cache and backend: one meter, one stats record (tokens, bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """KV-cache accounting of one sequence, comparable across policies and backends.

    Means are time averages over the decode steps (every forward after the prompt's prefill), taken
    for the active set and for full KV at the same steps, so a ratio of them does not depend on where
    in an eviction cycle the run stopped. Before the first decode step the means are the current values.

    Attributes:
        active_tokens: KV positions attended at the last step (tokens; a position counts once even when
            heads select different positions; max over layers).
        full_tokens: positions ever written for the sequence (prompt + generated): what full KV holds.
        active_bytes: bytes of K and V of the active set at the last step, all layers (bytes).
        full_bytes: bytes of K and V of all positions, all layers (bytes).
        peak_active_tokens: largest ``active_tokens`` of any forward, the prompt's prefill included.
        mean_active_tokens: time-averaged active positions over decode steps (tokens).
        mean_active_bytes / mean_full_bytes: time-averaged active and full K/V bytes, same steps (bytes).
        peak_active_bytes: largest ``active_bytes`` of any forward (bytes).
        bound_tokens: the policy's physical bound on active positions during decode (tokens): B + 1 for
            streaming and H2O (the token being decoded is attended before it is evicted), B + buffer for
            SnapKV and R-KV (KV-Rescue's B' = B + w; R-KV at least the first multiple of the buffer ≥ the
            prompt, + 1, as it keeps the prompt whole until then); None where it is not fixed in advance (full KV,
            SumR, ZoomR: the measured peak over decode steps is reported instead, see ``bound_measured``).
        bound_measured: True when ``bound_tokens`` is a measurement, not the policy's guarantee.
        device_kv_bytes: peak bytes allocated on the compute device for the sequence's K/V (capacity, not only
            used slots) plus the policy's state at the same forward (``policy_state_bytes``).
        host_kv_bytes: peak K/V bytes allocated in host memory by an offloading cache (0 for none).
        policy_state_bytes: peak bytes of the tensors the policy keeps on the compute device beside the K/V
            (H2O's accumulated scores, ZoomR's mean summary keys, the queries SnapKV, R-KV and ZoomR keep;
            see :meth:`zoomr.kvstore.policy.KVPolicy.state_bytes`); 0 for a policy that keeps none.
        mean_policy_state_bytes: ``policy_state_bytes`` time-averaged over the same decode steps (bytes).
        kv_device: the compute device's type (``cpu``, ``cuda``); on ``cpu`` device and host bytes live in
            the same RAM and add up.
        extra: policy-specific numbers (recomputes, agreeability; for SumR and ZoomR ``summaries_written``
            and ``segments_cut_auto``, see :meth:`zoomr.kvstore.segments.SegmentTracker.stats`, ...).
    """

    active_tokens: int
    full_tokens: int
    active_bytes: int
    full_bytes: int
    peak_active_tokens: int = 0
    extra: dict = field(default_factory=dict)
    mean_active_tokens: float | None = None
    mean_active_bytes: float | None = None
    mean_full_bytes: float | None = None
    peak_active_bytes: int | None = None
    bound_tokens: int | None = None
    bound_measured: bool = False
    device_kv_bytes: int = 0
    host_kv_bytes: int = 0
    kv_device: str = "cpu"
    policy_state_bytes: int = 0
    mean_policy_state_bytes: float | None = None

    def __post_init__(self):
        # a cache that keeps no history reports its current values as its means and peak
        if self.mean_active_tokens is None:
            self.mean_active_tokens = float(self.active_tokens)
        if self.mean_active_bytes is None:
            self.mean_active_bytes = float(self.active_bytes)
        if self.mean_full_bytes is None:
            self.mean_full_bytes = float(self.full_bytes)
        if self.peak_active_bytes is None:
            self.peak_active_bytes = self.active_bytes
        if self.mean_policy_state_bytes is None:
            self.mean_policy_state_bytes = float(self.policy_state_bytes)

    @property
    def saving(self) -> float:
        """Memory saving (×): mean full KV bytes / (mean active bytes + mean policy state bytes) over the same
        decode steps; 1.0 if empty. The state counts because only the policy puts it on the device: at 16K
        tokens and B = 64, H2O's fp32 scores weigh twice its attended fp32 K/V (head size 64)."""
        spent = self.mean_active_bytes + self.mean_policy_state_bytes
        return self.mean_full_bytes / spent if spent else 1.0

    @property
    def saving_peak(self) -> float:
        """Saving at the peak (×): full KV bytes at the end / (the largest active bytes + the largest policy
        state); the two peaks may fall on different forwards, so this never overstates it. 1.0 if empty."""
        spent = self.peak_active_bytes + self.policy_state_bytes
        return self.full_bytes / spent if spent else 1.0

    def as_dict(self) -> dict:
        """JSON-ready dict: the fields above plus ``saving`` and ``saving_peak`` (``extra`` merged in)."""
        return {
            "active_tokens": self.active_tokens,
            "full_tokens": self.full_tokens,
            "active_bytes": self.active_bytes,
            "full_bytes": self.full_bytes,
            "mean_active_tokens": round(self.mean_active_tokens, 2),
            "peak_active_tokens": self.peak_active_tokens,
            "bound_tokens": self.bound_tokens,
            "bound_measured": self.bound_measured,
            "mean_active_bytes": int(round(self.mean_active_bytes)),
            "mean_full_bytes": int(round(self.mean_full_bytes)),
            "peak_active_bytes": self.peak_active_bytes,
            "saving": round(self.saving, 3),
            "saving_peak": round(self.saving_peak, 3),
            "device_kv_bytes": self.device_kv_bytes,
            "host_kv_bytes": self.host_kv_bytes,
            "policy_state_bytes": self.policy_state_bytes,
            "mean_policy_state_bytes": int(round(self.mean_policy_state_bytes)),
            "kv_device": self.kv_device,
            **self.extra,
        }


class KVMeter:
    """Running KV accounting of one sequence, fed once per forward; makes :class:`KVStats`.

    One meter serves every cache (torch full KV, the offloaded policy cache, llama.cpp sequences) so
    the figures mean the same everywhere. Cost per forward: a few integer additions.

    Args:
        token_bytes: K+V bytes of one position over all layers (bytes).
        bound_tokens: the policy's fixed bound on active positions (tokens), or None (measured).
        kv_device: the compute device's type.
    """

    def __init__(self, token_bytes: int, bound_tokens: int | None = None, kv_device: str = "cpu"):
        self.token_bytes, self.bound, self.kv_device = token_bytes, bound_tokens, kv_device
        self.steps = 0
        self.sum_active = self.sum_active_bytes = self.sum_full = 0
        self.peak = self.peak_bytes = self.peak_decode = 0
        self.peak_device = self.peak_host = 0
        self.state = self.peak_state = self.sum_state = 0

    def step(self, active_tokens: int, active_bytes: int, full_tokens: int, is_prompt: bool,
             device_bytes: int = 0, host_bytes: int = 0, state_bytes: int = 0) -> None:
        """Account one forward: what was attended (tokens, bytes), positions written after it, allocations
        (K/V bytes on the device and in host memory) and the policy's state on the device after it (bytes)."""
        self.peak = max(self.peak, active_tokens)
        self.peak_bytes = max(self.peak_bytes, active_bytes)
        self.peak_device = max(self.peak_device, device_bytes + state_bytes)
        self.peak_host = max(self.peak_host, host_bytes)
        self.state = state_bytes
        self.peak_state = max(self.peak_state, state_bytes)
        if not is_prompt:
            self.steps += 1
            self.sum_active += active_tokens
            self.sum_active_bytes += active_bytes
            self.sum_full += full_tokens
            self.sum_state += state_bytes
            self.peak_decode = max(self.peak_decode, active_tokens)

    def stats(self, active_tokens: int, full_tokens: int, active_bytes: int, extra: dict | None = None) -> KVStats:
        """The :class:`KVStats` now, given the current active/full sizes."""
        n = self.steps
        bound, measured = self.bound, False
        if bound is None:
            bound, measured = (self.peak_decode if n else active_tokens), True
        return KVStats(
            active_tokens, full_tokens, active_bytes, full_tokens * self.token_bytes, self.peak, extra or {},
            mean_active_tokens=self.sum_active / n if n else float(active_tokens),
            mean_active_bytes=self.sum_active_bytes / n if n else float(active_bytes),
            mean_full_bytes=self.sum_full * self.token_bytes / n if n else float(full_tokens * self.token_bytes),
            peak_active_bytes=max(self.peak_bytes, active_bytes), bound_tokens=bound, bound_measured=measured,
            device_kv_bytes=self.peak_device, host_kv_bytes=self.peak_host, kv_device=self.kv_device,
            policy_state_bytes=self.peak_state,
            mean_policy_state_bytes=self.sum_state / n if n else float(self.state))

    def copy(self) -> "KVMeter":
        """An independent copy (for forks: a fork's history starts as its parent's)."""
        other = KVMeter.__new__(KVMeter)
        other.__dict__.update(self.__dict__)
        return other


def distinct_kv_bytes(caches) -> dict[str, int]:
    """K/V bytes a group of caches (a sequence and its forks) holds, each shared buffer counted once.

    Args:
        caches: objects with ``storages()`` (:class:`zoomr.kvstore.base.FullKVCache`,
            :class:`zoomr.kvstore.cache.PolicyKVCache`), yielding ``(where, tensor)`` pairs.
    Returns:
        ``{"host": bytes, "device": bytes}`` of distinct storages (allocated capacity, bytes).
    Raises:
        TypeError: a cache without ``storages()``.
    """
    held: list[tuple[str, object]] = []
    for cache in caches:
        if not hasattr(cache, "storages"):
            raise TypeError(f"{type(cache).__name__} does not list its storages")
        held += cache.storages()
    return {where: storage_bytes(t for w, t in held if w == where) for where in ("host", "device")}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (bytes): a view keeps its whole storage alive, and
    a storage two tensors share is counted once."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
