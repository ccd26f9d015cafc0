"""Building a backend from :class:`RunOptions`: one place that knows every runtime."""

from __future__ import annotations

from typing import Callable

from backends.base import Backend
from backends.models import resolve_model

from .errors import UserError
from .options import POLICIES, RunOptions


def _torch(opts: RunOptions) -> Backend:
    from backends.torch.engine import TorchBackend

    if opts.policy != "full":
        raise UserError(f"--policy {opts.policy} is not available on the torch backend yet")
    device = "cpu" if opts.n_gpu_layers == 0 and opts.device == "auto" else opts.device
    return TorchBackend(resolve_model(opts.model), device=device, dtype=opts.dtype, n_ctx=opts.ctx_size,
                        threads=opts.threads)


BACKENDS: dict[str, Callable[[RunOptions], Backend]] = {"torch": _torch}


def build_backend(opts: RunOptions) -> Backend:
    """The backend ``opts.backend`` names, with the model loaded.

    Raises:
        UserError: unknown backend name.
        backends.models.ModelNotFound, backends.torch.weights.ModelLoadError (ValueError): bad model.
    """
    if opts.backend not in BACKENDS:
        raise UserError(f"--backend {opts.backend!r} unknown (choose from {', '.join(BACKENDS)})")
    if opts.policy not in POLICIES:
        raise UserError(f"--policy {opts.policy!r} unknown (choose from {', '.join(POLICIES)})")
    if opts.ctx_size < 16:
        raise UserError(f"-c {opts.ctx_size} is too small (at least 16 tokens)")
    return BACKENDS[opts.backend](opts)
