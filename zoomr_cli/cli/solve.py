"""``zoomr solve``: one problem, reasoned step by step, final answer extracted from \\boxed{}."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from zoomr.backends.generation import GenerationStats, generate
from zoomr.backends.sampling import Sampler
from zoomr.kvstore.events import kv_events

from zoomr.errors import UserError
from zoomr.factory import build_backend
from zoomr.prompts import solve_prompt
from zoomr.grading import extract_answer
from zoomr.cli.inputs import check_writable, read_text_input, write_json
from zoomr.cli.kv_display import attach_live_events, policy_line
from zoomr.prompts import system_with_summaries
from zoomr.options import RunOptions
from zoomr.cli.options import model_options
from zoomr.cli.render import Output, stats_line
from zoomr.cli.rescue import run_rescue
from zoomr.rescue.plan import RescueOptions
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
    *,
    opts: RunOptions,
    rescue: RescueOptions,
) -> int:
    """Solve one problem: stream the reasoning, print the \\boxed{} answer and KV/speed statistics."""
    sources = [s for s in (file, prompt_file) if s is not None]
    if prompt is not None and sources or len(sources) > 1:
        raise UserError("give the problem once: FILE, -f FILE or -p TEXT")
    if prompt is None and not sources:
        raise UserError("no problem given: zoomr solve FILE (or -, or -p TEXT)")
    problem = prompt.strip() if prompt is not None else read_text_input(sources[0])
    if not problem:
        raise UserError("-p: the problem text is empty")
    check_writable(json_path)
    out = Output(live=not no_live, stdout_free=json_path == "-")
    if rescue.rescue:  # KV-Rescue lives in rescue_cli.py; plain solve continues below
        return run_rescue(problem, system, json_path, out, opts, rescue)
    sampler = Sampler(opts.sampling(default_temp=0.0))

    with out.status("loading model…"):
        backend = build_backend(opts)
    out.info(backend.describe())
    system = system_with_summaries(system, opts.policy, opts.summaries)
    ids = solve_prompt(backend.tokenizer, problem, system)
    if len(ids) >= backend.n_ctx:
        raise UserError(f"the prompt has {len(ids)} tokens, more than -c {backend.n_ctx} allows")

    seq = backend.new_sequence()
    if verbose:
        attach_live_events(kv_events(backend), out)
    gen = GenerationStats()
    code = 0
    try:
        for tok in generate(backend, seq, ids, sampler, opts.n_predict, gen, ignore_eos=opts.ignore_eos):
            out.token(tok.text)
    except KeyboardInterrupt:
        gen.stop_reason = "interrupted"
        code = 130
    out.token("\n")
    answer = extract_answer(gen.text, truncated=gen.stop_reason in ("length", "context", "interrupted"))
    kv = backend.kv_stats(seq)
    out.result("answer", answer if answer is not None else "(none found)")
    out.result("stats", stats_line(gen, kv), style="dim")
    if policy_line(kv):
        out.result("kv", policy_line(kv), style="dim")
    if json_path:
        record = {
            "problem": problem,
            "text": gen.text,
            "answer": answer,
            "tokens_generated": gen.generated_tokens,
            "prompt_tokens": gen.prompt_tokens,
            "stop_reason": gen.stop_reason,
            "model": backend.describe(),
            "sampling": vars(sampler.params),
            "kv": kv.as_dict(),
            "timing": {"prefill_s": round(gen.prefill_s, 4), "decode_s": round(gen.decode_s, 4),
                       "prefill_tok_s": round(gen.prefill_tok_s, 2), "decode_tok_s": round(gen.decode_tok_s, 2)},
        }
        where = write_json(json_path, record, indent=2)
        out.info(f"wrote {where}")
    if code:
        out.info("interrupted: partial result kept above" + (f" and in {where}" if json_path else ""))
    return code


solve_command = model_options(n_predict=512, shown={"temp": "0, greedy; 0.8 with --rescue"})(rescue_options(solve))
