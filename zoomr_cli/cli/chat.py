"""``zoomr chat``: an interactive REPL whose conversation stays in the KV cache across turns.

Each turn prefills only the new text: the conversation is rendered with the chat template, and the
part after what the cache already holds (decoded from the cached ids) is tokenized and prefilled.
When the template rewrote earlier turns, the sequence is rebuilt from scratch (said in /stats).
On a terminal the line is read with the stdlib ``readline`` (arrow keys edit it, Up/Down recall earlier
lines); the history lives in memory only, so nothing typed into a chat is written to disk.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from zoomr.backends.chat_prompt import chat_prompt
from zoomr.backends.generation import GenerationStats, generate
from zoomr.backends.sampling import Sampler
from zoomr.errors import check_text

from zoomr.factory import build_backend, check_options
from zoomr.options import RunOptions, check_knobs_read
from zoomr.prompts import solve_system
from zoomr.cli.options import OneSequence, loading, model_options, refuse_parallel
from zoomr.cli.render import Output, stats_line

COMMANDS = {
    "/help": "this list",
    "/stats": "last answer's speed and KV, and this conversation's turns and tokens",
    "/reset": "forget the conversation: free its KV cache and zero the /stats counters",
    "/exit": "quit (also /quit or Ctrl-D); Ctrl-C stops an answer",
}
HELP = "commands: " + ", ".join(COMMANDS) + " (or Ctrl-D)"


def help_text(editing: bool) -> str:
    """The /help listing: one line per command, then how lines are edited."""
    lines = [f"{name:<7} {what}" for name, what in COMMANDS.items()]
    lines.append("editing: arrow keys, Home/End, Up/Down for earlier lines (kept in memory, not on disk)" if editing
                 else "editing: none (stdin is not a terminal, or Python has no readline)")
    return "\n".join(lines)


def line_editing() -> bool:
    """Turn on line editing and in-memory history for ``input()`` when stdin is a terminal.

    Importing the stdlib ``readline`` is what makes ``input()`` edit lines; without it the terminal
    hands arrow keys to the program as escape bytes (``^[[D``), which would reach the model.
    Returns whether editing is on (False for pipes, or where Python was built without readline).
    """
    if not sys.stdin.isatty():
        return False
    try:
        import readline  # noqa: F401
    except ImportError:
        return False
    return True


class ChatSession:
    """A conversation over one backend sequence.

    Attributes:
        messages: the conversation so far ([{"role", "content"}]).
        rebuilds: times the cache had to be rebuilt because the template changed earlier text.
        last: the last answer's generation statistics.
        total: the conversation's sums: tokens prefilled and generated, seconds, decode steps.
    """

    def __init__(self, backend, sampler: Sampler, n_predict: int, system: str | None):
        self.backend, self.sampler, self.n_predict, self.system = backend, sampler, n_predict, system
        self.seq = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation, free its KV cache and zero the counters /stats shows."""
        if self.seq is not None:
            self.backend.free(self.seq)
        self.seq = self.backend.new_sequence()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.rebuilds = 0
        self.last = GenerationStats()
        self.total = GenerationStats()

    def _new_tokens(self, user_text: str) -> list[int]:
        tok = self.backend.tokenizer
        self.messages.append({"role": "user", "content": user_text})
        prompt = chat_prompt(tok, self.messages, add_generation_prompt=True)  # turns stay text, never control tokens
        held = tok.decode(self.seq.tokens)
        if self.seq.tokens and prompt.text.startswith(held):
            return prompt.encode(start=len(held))
        if self.seq.tokens:
            self.rebuilds += 1
            self.backend.free(self.seq)
            self.seq = self.backend.new_sequence()
        return prompt.encode()

    def ask(self, user_text: str, out: Output) -> GenerationStats:
        """Answer one user turn, streaming to ``out``; Ctrl-C keeps the partial answer in the conversation.

        Raises:
            ValueError: the conversation no longer fits ``-c`` (use /reset).
        """
        gen = GenerationStats()
        try:
            ids = self._new_tokens(user_text)
            if len(self.seq.tokens) + len(ids) >= self.backend.n_ctx:
                self.messages.pop()
                raise ValueError(f"context full ({len(self.seq.tokens)} + {len(ids)} tokens ≥ -c "
                                 f"{self.backend.n_ctx}): /reset to start over")
            for tok in generate(self.backend, self.seq, ids, self.sampler, self.n_predict, gen):
                out.token(tok.text)
        except KeyboardInterrupt:
            gen.stop_reason = "interrupted"
        finally:
            if self.messages and self.messages[-1]["role"] == "user":
                self.messages.append({"role": "assistant", "content": gen.text})
            self.last = gen
            self._add(gen)
        out.token("\n")
        return gen

    def _add(self, gen: GenerationStats) -> None:
        t = self.total
        t.prompt_tokens += gen.prompt_tokens
        t.generated_tokens += gen.generated_tokens
        t.prefill_s += gen.prefill_s
        t.decode_s += gen.decode_s
        t.decode_steps += gen.decode_steps

    def stats(self) -> str:
        """The /stats line: last answer's speed, the cache's KV accounting, then since the start or /reset:
        turns, tokens prefilled and generated, mean decode speed, cache rebuilds."""
        kv = self.backend.kv_stats(self.seq)
        turns = sum(m["role"] == "user" for m in self.messages)
        t = self.total
        return (f"{stats_line(self.last, kv)} · conversation: turns {turns}, prefill {t.prompt_tokens} tok, "
                f"decode {t.generated_tokens} tok @ {t.decode_tok_s:.1f} tok/s · cache rebuilds {self.rebuilds}")


def chat(
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    no_live: Annotated[bool, typer.Option("--no-live", help="Plain text output.")] = False,
    parallel: OneSequence = None,
    *,
    opts: RunOptions,
) -> int:
    """Chat interactively; the conversation stays in the KV cache. /help, /stats, /reset, /exit; Ctrl-C stops an answer."""
    refuse_parallel(parallel, "chat")
    check_knobs_read(opts)
    sampler = Sampler(opts.sampling(default_temp=0.7))
    out = Output(live=not no_live)
    check_options(opts)  # bad flags refused before "loading model…"
    with loading(out, opts):
        backend = build_backend(opts)
    out.info(backend.describe())
    editing = line_editing()
    # piped in (llama.cpp's way): no prompt, and stdout holds the answers alone; /stats and notes go to stderr
    interactive = sys.stdin.isatty()
    out.info(HELP)
    # --summaries prompted asks for delimited summaries here as solve does (one prompt builder)
    session = ChatSession(backend, sampler, opts.n_predict, solve_system(backend, system))
    while True:
        try:
            if not _handle(input("> " if interactive else "").strip(), session, out, editing, interactive):
                return 0
        except UnicodeDecodeError as e:   # stdin decoded strictly (a UTF-8 locale): the chunk is dropped
            out.info(f"error: input is not valid UTF-8 (byte {e.start} of the chunk read); that input was not sent")
        except EOFError:
            if interactive:
                out.token("\n")  # ends the prompt's line
            return 0
        except KeyboardInterrupt:  # at the prompt, or between an answer's end and the next prompt
            out.token("\n")
            out.info("(Ctrl-D or /exit to quit)")


def _handle(line: str, session: ChatSession, out: Output, editing: bool, interactive: bool = True) -> bool:
    """Run one REPL line; False means exit. Not ``interactive`` (stdin piped): /stats goes to stderr."""
    if not line:
        return True
    if line in ("/exit", "/quit"):
        return False
    if line == "/help":
        out.info(help_text(editing))
    elif line == "/stats":
        if interactive:
            out.result("stats", session.stats(), style="dim")
        else:
            out.info(f"stats: {session.stats()}")
    elif line == "/reset":
        session.reset()
        out.info("conversation reset")
    elif line.startswith("/"):
        out.info(f"unknown command {line.split()[0]}; {HELP}")
    else:
        try:
            # a line with bytes that are not UTF-8 is refused whole (the conversation goes on), like solve's file
            session.ask(check_text(line, "this line"), out)
        except ValueError as e:
            out.info(f"error: {e}")
    return True


chat_command = model_options(exclude=("ignore_eos",), n_predict=256, temp=0.7)(chat)
