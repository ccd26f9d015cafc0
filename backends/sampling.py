"""Token sampling over float32 logits: temperature, top-k, top-p, seeded; greedy at temperature 0.

Order of the filters follows llama.cpp's default chain (top-k, then top-p, then temperature).

One implementation serves one sequence and a batch: :func:`sample_batch` filters and draws B rows of
logits on the logits' own device (torch tensor, or numpy on the host) and moves only B ids (and, when
asked, B entropies) to the host; :meth:`Sampler.sample` is that function on one row. Randomness is
one uniform per sampled token from each sequence's own seeded numpy stream (drawn on the host: B
floats go to the device, nothing comes back but ids), turned into a token by inverse CDF over the
filtered candidates in descending-probability order, the way ``numpy.random.Generator.choice`` does.
So a sequence sampled alone or inside any batch draws the same tokens for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: keep the k most likely tokens (0 = no limit).
        top_p: keep the smallest set whose probability mass reaches p (1.0 = no limit).
        seed: RNG seed; the same seed and logits give the same tokens.

    Raises:
        ValueError: from :meth:`validate` on a negative or infinite temperature, a negative top-k or seed, or
            top-p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0

    def validate(self) -> "SamplingParams":
        """Return self, or raise ValueError naming the first invalid value."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temp must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:   # numpy's generators take none; refused here, before any model loads
            raise ValueError(f"-s/--seed must be >= 0, got {self.seed}")
        return self


class Sampler:
    """Draws token ids from logits with :class:`SamplingParams` and its own RNG stream.

    Each sampled (temperature > 0) token consumes exactly one uniform of the stream, even when the
    filters leave one candidate, so the stream's position depends only on the tokens drawn.
    """

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def substream(self, *key: int) -> "Sampler":
        """A sampler with the same settings and its own stream, seeded by (seed, *key) (non-negative ints).

        Independent of how much of this sampler's stream was used, so one sequence's draws do not
        depend on whether another was sampled before it or beside it in a batch (KV-Rescue keys each
        candidate by (step, index)).
        """
        child = Sampler(self.params)
        child.rng = np.random.default_rng([self.params.seed % (1 << 64), *key])
        return child

    def uniform(self) -> float:
        """The next uniform in [0, 1) of this sampler's stream (one per sampled token)."""
        return float(self.rng.random())

    def probs(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ids and their renormalized probabilities after top-k/top-p/temperature.

        Args:
            logits: shape [vocab], float.
        Returns:
            (ids [n], probs [n]) in descending probability, probs summing to 1; n == 1 when greedy.
        """
        row = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]
        if self.params.temperature == 0.0:
            return np.array([int(row.argmax())]), np.ones(1)
        ids, probs = _filtered(row, [self.params])
        keep = probs[0] > 0
        return ids[0][keep].numpy(), probs[0][keep].numpy()

    def sample(self, logits: np.ndarray) -> int:
        """One token id drawn from ``logits`` (shape [vocab])."""
        if self.params.temperature == 0.0:
            return int(np.argmax(logits))   # first maximum, as torch's argmax in sample_batch
        row = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))[None]
        return int(sample_batch(row, [self])[0][0])


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then temperature, per row, on ``logits``' device.

    Args:
        logits: [B, V] float.
        params: B settings, all with temperature > 0.
    Returns:
        (ids [B, K] int64, probs [B, K] float64): each row's K most likely ids in descending order
        (K = the largest top-k of the batch, V for top-k 0) and their probabilities, 0 where a filter
        dropped the id, each row summing to 1.
    """
    B, V = logits.shape
    dev = logits.device
    kk = [p.top_k if 0 < p.top_k < V else V for p in params]
    K = max(kk)
    if K == V:
        vals, ids = logits.sort(dim=-1, descending=True, stable=True)
    else:
        vals, ids = logits.topk(K, dim=-1, sorted=True)
    z = vals.double()
    valid = torch.arange(K, device=dev)[None, :] < torch.tensor(kk, device=dev)[:, None]
    z0 = z[:, :1]
    if any(p.top_p < 1.0 for p in params):
        p1 = torch.where(valid, (z - z0).exp(), 0.0)
        p1 = p1 / p1.sum(-1, keepdim=True)
        # keep the smallest prefix whose mass reaches top-p: an id stays while the mass before it is < p
        before = torch.cat([torch.zeros(B, 1, dtype=p1.dtype, device=dev), p1.cumsum(-1)[:, :-1]], dim=1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)[:, None]
        valid = valid & ((before < top_p) | (top_p >= 1.0))
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)[:, None]
    e = torch.where(valid, ((z - z0) / temp).exp(), 0.0)
    return ids, e / e.sum(-1, keepdim=True)


def row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax of each row (nats), computed where ``logits`` lives.

    Args:
        logits: [B, V] float.
    Returns:
        [B] float64: log Σe^z − Σ p z (z = row − its max; no log of an underflowed probability).
    """
    z = logits.double()
    z = z - z.amax(-1, keepdim=True)
    e = z.exp()
    s = e.sum(-1)
    return s.log() - (e * z).sum(-1) / s


def sample_batch(logits: torch.Tensor | np.ndarray, samplers: list[Sampler], entropy: bool = False
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """Draw one token for each of B sequences from their logits, on the logits' device.

    Row b uses ``samplers[b]``'s settings and stream (greedy rows take the argmax and draw nothing);
    only the B ids (and B entropies) cross to the host.

    Args:
        logits: [B, vocab] float (a torch tensor on any device, or numpy on the host).
        samplers: B samplers, one per sequence (distinct objects, or a sequence's stream advances twice).
        entropy: also return each row's entropy of softmax(logits) in nats (rescue's detector).
    Returns:
        (ids [B] int64 numpy, entropies [B] float64 numpy or None).
    Raises:
        ValueError: logits not 2-D, or a row count other than ``len(samplers)``.
    """
    if isinstance(logits, np.ndarray):
        logits = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"sample_batch needs [B, vocab] logits for {len(samplers)} samplers, got "
                         f"{tuple(logits.shape)}")
    rows = [b for b, s in enumerate(samplers) if s.params.temperature > 0.0]
    out = logits.argmax(dim=-1) if len(rows) < len(samplers) else None
    if rows:
        sub = logits if len(rows) == len(samplers) else logits[torch.tensor(rows, device=logits.device)]
        ids, probs = _filtered(sub, [samplers[b].params for b in rows])
        cdf = probs.cumsum(-1)
        cdf = cdf / cdf[:, -1:]
        u = torch.tensor([samplers[b].uniform() for b in rows], dtype=torch.float64, device=logits.device)
        pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=ids.shape[1] - 1)
        drawn = ids.gather(1, pick)[:, 0]
        if len(rows) == len(samplers):
            out = drawn
        else:
            out[torch.tensor(rows, device=logits.device)] = drawn
    ent = row_entropy(logits).cpu().numpy() if entropy else None
    return out.cpu().numpy(), ent
