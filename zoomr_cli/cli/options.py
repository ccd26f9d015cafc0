"""Options shared by every command that runs a model (llama.cpp names where they exist).

:func:`model_options` adds them to a Typer command's signature and hands the command one
:class:`RunOptions`, so ``solve``, ``chat`` and ``bench`` declare them once.
"""

from __future__ import annotations

import copy
import functools
import inspect
import typing
from dataclasses import fields
from typing import Annotated, Optional

import typer

from zoomr.kvstore.registry import KnobFlag, knob_flags, policy_names
from zoomr.options import RunOptions

PANEL_MODEL = "Model and backend"
PANEL_SAMPLING = "Sampling"
PANEL_KV = "KV policy"


_OPTION_DECLS = {
    "model": (Optional[str], typer.Option("-m", "--model", help="GGUF file, HF model directory or hub id "
                                          "(default: the embedded SmolLM2-135M-Instruct).", rich_help_panel=PANEL_MODEL)),
    "backend": (str, typer.Option("--backend", help="Model runtime: torch (our decoder) or llamacpp (llama.cpp); both run every KV policy.",
                                  rich_help_panel=PANEL_MODEL)),
    "ctx_size": (int, typer.Option("-c", "--ctx-size", help="Most KV positions a sequence may hold (tokens).",
                                   rich_help_panel=PANEL_MODEL)),
    "n_predict": (int, typer.Option("-n", "--n-predict", help="Most tokens to generate (-1: until EOS or -c).",
                                    rich_help_panel=PANEL_MODEL)),
    "threads": (Optional[int], typer.Option("-t", "--threads", help="CPU threads (default: all cores).",
                                            rich_help_panel=PANEL_MODEL)),
    "n_gpu_layers": (int, typer.Option("-ngl", "--n-gpu-layers", help="llamacpp: layers offloaded to the "
                                                 "GPU; torch: 0 forces the CPU.", show_default="-1, all",
                                                 rich_help_panel=PANEL_MODEL)),
    "device": (str, typer.Option("--device", help="torch: auto (CUDA if present), cpu, cuda, cuda:N.",
                                 rich_help_panel=PANEL_MODEL)),
    "dtype": (str, typer.Option("--dtype", help="torch compute dtype: auto (bf16 on CUDA; on CPU bf16 or fp16, "
                                "whichever this machine runs faster, measured once), fp32, bf16, fp16.",
                                rich_help_panel=PANEL_MODEL)),
    "quant": (str, typer.Option("--quant", help="torch weights: auto (a GGUF on a CPU with --dtype auto: ggml or "
                                "int4, whichever decodes faster here, measured once; else the GGUF's Q4_0/Q4_1/Q5_0/"
                                "Q5_1/Q8_0/Q4_K/Q5_K blocks kept in the int4 kernel, exact, Q6_K regrouped to 32; none "
                                "for HF models and --dtype fp32), ggml (GGUF on CPU: the file's blocks in llama.cpp's "
                                "ggml kernels, 8-bit activations, fp32: refuses a half --dtype and --compile), none, int8, int4 "
                                "(quantized at load), "
                                "fp16 (fp16 weights, fp32 compute: fbgemm on x86 CPUs; most faithful of the compact "
                                "forms; refuses a half --dtype), w8a8 (int8 weights and activations: fbgemm on x86 CPUs; "
                                "fastest prefill and batches there, slower one-row decode, lossy; refuses a half --dtype: "
                                "docs/backends.md).",
                                rich_help_panel=PANEL_MODEL)),
    "kv_dtype": (str, typer.Option("--kv-dtype", help="torch KV cache and attention dtype: auto (fp32 on a CPU, "
                                   "where half-precision attention runs slower; the compute dtype on CUDA), fp32, "
                                   "bf16, fp16.", rich_help_panel=PANEL_MODEL)),
    "compile": (bool, typer.Option("--compile", help="torch: run decode steps' layer math through torch.compile, "
                                   "compiled at load (seconds to a minute; needs a C++ compiler on a CPU, where it "
                                   "measured slower than eager).",
                                   rich_help_panel=PANEL_MODEL)),
    "temp": (Optional[float], typer.Option("--temp", help="Temperature; 0 = greedy.", rich_help_panel=PANEL_SAMPLING)),
    "top_k": (int, typer.Option("--top-k", help="Top-k filter (0 = off).", rich_help_panel=PANEL_SAMPLING)),
    "top_p": (float, typer.Option("--top-p", help="Top-p (nucleus) filter, in (0, 1].", rich_help_panel=PANEL_SAMPLING)),
    "seed": (int, typer.Option("-s", "--seed", help="RNG seed for sampling.", rich_help_panel=PANEL_SAMPLING)),
    "ignore_eos": (bool, typer.Option("--ignore-eos", help="Never sample end-of-sequence: generate -n tokens "
                                      "(long-context measurements; not the rescue loop).",
                                      rich_help_panel=PANEL_SAMPLING)),
    "policy": (str, typer.Option("--policy", help=f"KV policy: {', '.join(policy_names())} (docs/policies.md).",
                                 rich_help_panel=PANEL_KV)),
}


def knob_option(knob: KnobFlag):
    """The Typer option of one policy knob: ``--window``, its readers in the help, its readers' common default
    (None when they differ: each then keeps its own)."""
    decl = knob.flag if knob.type is not bool else f"{knob.flag}/--no-{knob.flag[2:]}"
    return (Optional[knob.type], typer.Option(decl, help=f"{', '.join(knob.readers)}: {knob.info.help}.",
                                              show_default="each policy's own" if knob.default is None else True,
                                              rich_help_panel=PANEL_KV))


def knob_options() -> dict:
    """``{knob name: (type, typer.Option)}`` for every knob of every registered policy (see :mod:`zoomr.kvstore.knobs`)."""
    return {name: knob_option(k) for name, k in knob_flags().items()}


def model_options(exclude: tuple[str, ...] = (), shown: dict[str, str] | None = None,
                  helps: dict[str, str] | None = None, **defaults):
    """Decorator: add the shared options to a Typer command; the command receives ``opts: RunOptions``.

    The policy knobs are generated from the policy registry (:func:`knob_options`); ``opts.knobs`` holds
    those given on the command line (a default never counts as given).

    Args:
        exclude: option names the command declares its own way (e.g. bench's repeatable ``--budget``);
            they keep RunOptions' defaults in ``opts`` (an excluded knob is not given).
        shown: what ``--help`` gives as the default of options the command resolves itself when they are
            not given (``--temp``: None in RunOptions, the command's own temperature), by option name.
        helps: the command's own ``--help`` text of shared options whose meaning it narrows, by option name
            (bench's ``--backend``: torch only).
        defaults: overrides of RunOptions' defaults for this command (for example ``n_predict=1024``).
    """
    base = {f.name: f.default for f in fields(RunOptions) if f.name != "knobs"}
    base.update(defaults)
    decls = {k: v for k, v in _OPTION_DECLS.items() if k not in exclude}
    for attr, texts in (("show_default", shown), ("help", helps)):
        for name, text in (texts or {}).items():
            typ, opt = decls[name]
            opt = copy.copy(opt)  # the declaration is shared by every command
            setattr(opt, attr, text)
            decls[name] = (typ, opt)
    knobs = {k: v for k, v in knob_options().items() if k not in exclude}
    clash = sorted(set(knobs) & set(base))
    if clash:
        raise TypeError(f"policy knob {clash[0]!r} has the name of a run option; rename the knob")
    knob_defaults = {name: k.default for name, k in knob_flags().items() if name in knobs}

    def build(values: dict, typed: set[str]) -> RunOptions:
        # only knobs typed on the command line are given (a default is each reader's own anyway); one typed at
        # its default value still counts, so that a command can refuse it for a policy without that knob
        knob_values = {k: values.pop(k) for k in knobs}
        return RunOptions(**values, **{name: base[name] for name in exclude if name in base},
                          knobs={k: v for k, v in knob_values.items() if v is not None and k in typed})

    def wrap(fn):
        return grouped_options(fn, "opts", {**decls, **knobs}, {**base, **knob_defaults}, build)

    return wrap


def gpu_layers_note(opts: RunOptions) -> str | None:
    """The line saying that ``-ngl N`` has no effect here (None when it has one, or N is 0 or the default -1).

    ``-ngl N`` (N > 0) moves layers to a GPU only on a llama.cpp build with GPU offload, or for torch
    where CUDA is present and ``--device`` is ``auto``; elsewhere the run is on the CPU whatever N says (a
    ``--device cuda`` without CUDA gets its own error instead).
    """
    if opts.n_gpu_layers <= 0:
        return None
    flag = f"-ngl {opts.n_gpu_layers}"
    if opts.backend == "llamacpp":
        from zoomr.backends.llamacpp.runtime import gpu_offload_supported

        if not gpu_offload_supported():
            return f"{flag} has no effect: this llama.cpp build has no GPU offload, every layer runs on the CPU"
    elif opts.backend == "torch":
        import torch

        if opts.device != "auto":   # an explicit --device decides alone (and is refused where it cannot run)
            return f"{flag} has no effect: --device {opts.device} places the model" if opts.device == "cpu" else None
        if not torch.cuda.is_available():
            return f"{flag} has no effect: torch finds no CUDA device, the model runs on the CPU"
    return None


def loading(out, opts: RunOptions, what: str | None = None):
    """Say that the model loads: the ``-ngl`` note first, if any (:func:`gpu_layers_note`), then a status
    context (``out.status``) to hold while it loads. Called after the options were checked, so a refused run
    prints its error line alone.

    Args:
        out: the command's :class:`~zoomr.cli.render.Output`.
        what: the status text (default: :func:`loading_status`).
    """
    note = gpu_layers_note(opts)
    if note:
        out.info(f"zoomr: {note}")
    return out.status(what or loading_status(opts))


_CONTEXT = "zoomr_click_context"  # the click context Typer hands a command that asks for one


def grouped_options(fn, param: str, decls: dict, defaults: dict, build):
    """Replace ``fn``'s parameter ``param`` by one Typer option per entry of ``decls``.

    The returned command takes the options as keyword arguments, rebuilds the group with
    ``build({name: value}, typed)`` and calls ``fn(param=group, ...)``; ``fn``'s other parameters are kept.
    ``typed`` is the set of names whose value came from the command line (click's parameter source), not
    from the default.

    Args:
        decls: ``{name: (type, typer.Option(...))}``; defaults: ``{name: default}`` for each of them.
    """
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)  # the command module may defer annotations
    own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != param]
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name],
                               annotation=Annotated[typ, opt]) for name, (typ, opt) in decls.items()]
    # stacked groups share one context parameter: the outermost adds it, the innermost takes it away
    passes_context = _CONTEXT in sig.parameters
    if not passes_context:
        extra.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    @functools.wraps(fn)
    def command(**kwargs):
        ctx = kwargs[_CONTEXT] if passes_context else kwargs.pop(_CONTEXT)
        typed = {name for name in decls if _typed(ctx, name)}
        group = build({name: kwargs.pop(name) for name in decls}, typed)
        return fn(**{param: group}, **kwargs)

    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + extra
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # Typer must read the new signature, not fn's
    return command


def _typed(ctx, name: str) -> bool:
    """The value of parameter ``name`` came from the command line (or its environment variable)."""
    source = ctx.get_parameter_source(name)
    # by name: the enum is click's own or the copy Typer vendors, depending on Typer's version
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


# solve and chat run one sequence; without this, click reads bench's "-np 2" there as "-n p" and blames -n
OneSequence = Annotated[Optional[str], typer.Option("-np", "--parallel", hidden=True)]


def refuse_parallel(value: str | None, command: str) -> None:
    """Refuse ``-np/--parallel`` on a command that decodes one sequence.

    Raises:
        UserError: naming ``zoomr bench`` as the command that takes it.
    """
    if value is not None:
        from zoomr.errors import UserError

        rescue = " (solve --rescue batches its candidates by itself)" if command == "solve" else ""
        raise UserError(f"-np/--parallel: zoomr {command} decodes one sequence; zoomr bench runs several in "
                        f"parallel{rescue}")


def loading_status(opts: RunOptions) -> str:
    """The status line shown while a command loads its model (``--compile`` makes that take longer)."""
    return "loading model and compiling its decode steps (up to a minute)…" if opts.compile else "loading model…"
