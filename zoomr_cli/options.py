"""What one run of a model needs: model, backend, context, sampling and KV policy (llama.cpp names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from zoomr.backends.sampling import SamplingParams
from zoomr.errors import UserError
from zoomr.kvstore.registry import REFERENCE, knob_flags, policy_info


@dataclass
class RunOptions:
    """Model, backend, sampling and KV-policy settings of one command invocation (units: tokens, threads).

    Attributes:
        knobs: the policy knobs given, {knob name: value} (``{"window": 8}`` for ``--window 8``); a knob
            not given keeps each policy's default. One command may hold knobs of several policies (bench,
            rescue's base): each policy reads only its own (:meth:`policy_knobs`).
    """

    model: Optional[str] = None
    backend: str = "torch"
    ctx_size: int = 4096
    n_predict: int = 512
    threads: Optional[int] = None
    n_gpu_layers: int = -1
    device: str = "auto"
    dtype: str = "auto"
    # torch: weight quantization (auto: a GGUF's own blocks, none for HF; none, int8, int4, fp16, w8a8)
    quant: str = "auto"
    # torch: KV cache / attention dtype (auto: fp32 on a CPU, the compute dtype on CUDA)
    kv_dtype: str = "auto"
    # torch: decode steps through torch.compile (off: on the CPUs measured it paid nothing)
    compile: bool = False
    temp: Optional[float] = None
    # KV-Rescue's (arXiv:2608.15797) top-k for every command: solve and bench run --rescue with it, and
    # bench records it; greedy runs (--temp 0) do not read it. llama.cpp's own default is 40.
    top_k: int = 20
    top_p: float = 0.95
    seed: int = 0
    ignore_eos: bool = False
    policy: str = REFERENCE
    knobs: dict[str, Any] = field(default_factory=dict)

    def knob(self, name: str) -> Any:
        """The value of knob ``name``: as given, else the policies' common default (None when they differ)."""
        return self.knobs[name] if name in self.knobs else knob_flags()[name].default

    def with_knobs(self, **knobs) -> "RunOptions":
        """A copy with ``knobs`` set (None: not given)."""
        merged = {k: v for k, v in {**self.knobs, **knobs}.items() if v is not None}
        return dataclasses.replace(self, knobs=merged)

    def check_knobs(self) -> None:
        """Every knob given is some policy's and in its range, whichever policy will read it.

        Raises:
            ValueError: a knob no policy has, or a value out of range (naming the flag).
        """
        flags = knob_flags()
        for name, value in self.knobs.items():
            if name not in flags:
                raise ValueError(f"policy knob {name!r} unknown (knobs: {', '.join(flags)})")
            flags[name].check(value)

    def policy_knobs(self, policy: str | None = None) -> dict[str, Any]:
        """The knobs given that ``policy`` (default: :attr:`policy`) has; the others are not its own.

        Raises:
            ValueError: an unknown policy.
        """
        names = policy_info(self.policy if policy is None else policy).knob_names
        return {k: v for k, v in self.knobs.items() if k in names}

    def sampling(self, default_temp: float) -> SamplingParams:
        """Validated sampling params; ``default_temp`` applies when ``--temp`` was not given.

        Raises:
            ValueError: an invalid sampling value.
        """
        temp = default_temp if self.temp is None else self.temp
        return SamplingParams(temperature=temp, top_k=self.top_k, top_p=self.top_p, seed=self.seed).validate()


def knob_scope(policies: list[str], opts: RunOptions, chosen: str | None = None) -> list[str]:
    """Which of ``policies`` each knob given applies to, as lines to show the user.

    A knob none of them has is an error (it would silently do nothing); one that only some have is applied
    to those alone (the others have no such knob) and said so.

    Args:
        policies: the policies that will run (bench's ``--policies``, or the one of solve and chat).
        opts: the knobs given (``opts.knobs``: only those set on the command line).
        chosen: how the refusal names a single policy that runs (``--policy full``, ``--base-policy rkv``);
            None: the policies are bench's ``--policies``.
    Raises:
        UserError: a knob given that none of ``policies`` reads, naming the flag and the policies that do.
    """
    flags = knob_flags()
    lines = []
    for name, value in opts.knobs.items():
        knob = flags[name]
        applies = [p for p in policies if p in knob.readers]
        if not applies:
            raise UserError(not_read(knob.flag, knob.readers, chosen))
        if len(applies) < len(policies):
            lines.append(f"{knob.flag} {value} applies to {', '.join(applies)} only")
    return lines


def not_read(flag: str, readers: tuple[str, ...], chosen: str | None = None) -> str:
    """The refusal of a knob that no policy run reads (``chosen``: see :func:`knob_scope`)."""
    tail = f"not by {chosen}" if chosen else "and none of --policies is one of them"
    return f"{flag} is read by {', '.join(readers)} only, {tail}"


def check_knobs_read(opts: RunOptions, flag: str = "--policy") -> None:
    """Refuse a knob given that ``opts.policy`` (the one policy a solve or chat runs) does not read.

    Args:
        flag: the option that chose the policy, for the message (``--policy``, ``--base-policy``).
    Raises:
        ValueError: an unknown policy.
        UserError: ``--sink is read by streaming only, not by --policy full``.
    """
    policy_info(opts.policy)
    knob_scope([opts.policy], opts, f"{flag} {opts.policy}")
