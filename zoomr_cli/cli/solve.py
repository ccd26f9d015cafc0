"""``zoomr solve``: one problem, reasoned step by step, final answer extracted from \\boxed{}."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from zoomr import solving
from zoomr.errors import UserError, check_text
from zoomr.factory import build_backend, check_options
from zoomr.kvstore.events import kv_events
from zoomr.options import RunOptions, check_knobs_read
from zoomr.rescue.plan import RescueOptions

from zoomr.cli.inputs import check_writable, read_text_input, write_json
from zoomr.cli.kv_display import attach_live_events, policy_line
from zoomr.cli.options import OneSequence, loading, model_options, refuse_parallel
from zoomr.cli.render import Output, stats_line
from zoomr.cli.rescue import solve_with_rescue
from zoomr.cli.rescue_options import rescue_options


def solve(
    file: Annotated[Optional[str], typer.Argument(help="Problem text file, or - for stdin.")] = None,
    prompt: Annotated[Optional[str], typer.Option("-p", "--prompt", help="The problem as text.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("-f", "--file", help="Problem file (same as FILE).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write a JSON record of the run here; - for "
                                                     "stdout (then the text and results go to stderr).")] = None,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain text output for pipes.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Also print every KV-policy recompute (ZoomR "
                                          "zooms, sumr segments) as it happens, on stderr.")] = False,
    parallel: OneSequence = None,
    *,
    opts: RunOptions,
    rescue: RescueOptions,
) -> int:
    """Solve one problem: stream the reasoning, print the \\boxed{} answer and KV/speed statistics."""
    refuse_parallel(parallel, "solve")
    sources = [s for s in (file, prompt_file) if s is not None]
    if prompt is not None and sources or len(sources) > 1:
        raise UserError("give the problem once: FILE, -f FILE or -p TEXT")
    if prompt is None and not sources:
        raise UserError("no problem given: zoomr solve FILE (or -, or -p TEXT)")
    problem = check_text(prompt, "-p").strip() if prompt is not None else read_text_input(sources[0])
    if not problem:
        raise UserError("-p: the problem text is empty")
    if system is not None:
        check_text(system, "--system")
    check_writable(json_path)
    out = Output(live=not no_live, stdout_free=json_path == "-")
    if rescue.rescue:  # KV-Rescue lives in zoomr.cli.rescue; plain solve continues below
        return solve_with_rescue(problem, system, json_path, out, opts, rescue)
    check_knobs_read(opts)
    sampling = opts.sampling(default_temp=0.0)

    check_options(opts)  # bad flags refused before "loading model…"
    with loading(out, opts):
        backend = build_backend(opts)
    # a prompt over -c is refused before the model line: the error is then the only line after "loading model…";
    # solving.solve builds the same ids again (the summary instruction its policy asks for included)
    solving.solve_ids(backend, problem, system)
    out.info(backend.describe())
    if verbose:
        attach_live_events(kv_events(backend), out)
    result = solving.solve(backend, problem, system=system, sampling=sampling, n_predict=opts.n_predict,
                           ignore_eos=opts.ignore_eos, on_token=out.token)
    code = 130 if result.stop_reason == "interrupted" else 0
    out.token("\n")
    out.result("answer", result.answer if result.answer is not None else "(none found)")
    out.result("stats", stats_line(result.stats, result.kv), style="dim")
    if policy_line(result.kv):
        out.result("kv", policy_line(result.kv), style="dim")
    if json_path:
        where = write_json(json_path, result.record(), indent=2)
        if json_path != "-":   # a record on stdout speaks for itself
            out.info(f"wrote {where}")
    if code:
        out.info("interrupted: partial result kept above" + (f" and in {where}" if json_path else ""))
    return code


solve_command = model_options(n_predict=512, shown={"temp": "0, greedy; 0.8 with --rescue"})(rescue_options(solve))
