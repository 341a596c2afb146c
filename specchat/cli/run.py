"""`specchat run`: chat with a model. `--plain` is a streaming REPL on stdin/stdout (no TUI)."""

from __future__ import annotations

import contextlib
import io
import sys

import click

from specchat.cli.inputs import is_non_utf8
from specchat.cli.options import (
    StderrProgress,
    engine_config,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
    spec_params,
)
from specchat.errors import PromptError

REPL_HELP = "Type a message and press Enter (end a line with \\ to continue it). /reset clears the chat, /exit quits."


def read_message() -> str | None:
    """One user message from stdin (None at end of input); a trailing backslash continues the line.

    Bytes that are not UTF-8 end the chat in one error line (PromptError), whatever the locale's decoding does.
    """
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors != "surrogateescape":
        sys.stdin.reconfigure(errors="surrogateescape")  # undecodable bytes arrive as lone surrogates, refused below
    lines = []
    while True:
        try:
            line = input("> " if not lines else ". ")
        except EOFError:
            return "\n".join(lines) if lines else None
        if is_non_utf8(line):
            raise PromptError("stdin: the message is not valid UTF-8")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def plain_repl(engine, sampling, spec, system: str | None) -> None:
    """Read, stream, repeat. Ctrl-C stops the current answer and keeps the conversation."""
    from specchat.engine.sequence import Finished, TextDelta

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    click.echo(REPL_HELP, err=True)
    while True:
        text = read_message()
        if text is None or text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            messages = messages[:1] if system else []
            click.echo("(conversation cleared)", err=True)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        handle = engine.submit(messages, sampling, spec)
        reply = ""
        try:
            for event in handle.events():
                if isinstance(event, TextDelta):
                    reply += event.text
                    click.echo(event.text, nl=False)
                elif isinstance(event, Finished):
                    reply = event.text
                    s = event.stats
                    click.echo(
                        f"\n[{len(event.token_ids)} tokens, {event.tok_per_s:.1f} tok/s, "
                        f"{s.tokens_per_step or 1:.2f} tokens/step, {event.reason}]",
                        err=True,
                    )
        except KeyboardInterrupt:
            handle.cancel()
            handle.result()
            click.echo("\n[stopped]", err=True)
        messages.append({"role": "assistant", "content": reply})


@click.command()
@model_options
@click.option("--system", help="system message")
@click.option("--plain", is_flag=True, help="a plain streaming REPL instead of the TUI")
@sampling_options
@spec_options
def run(model, device, dtype, weights, system, plain, max_tokens, temperature, top_p, top_k, seed, drafter, k) -> None:
    """Chat with MODEL (default: smollm2-135m)."""
    from specchat.engine.engine import Engine

    sampling = sampling_params(max_tokens, temperature, top_p, top_k, seed)
    spec = spec_params(drafter, k)
    config = engine_config(model, device, dtype, weights=weights)
    if not plain and sys.stdin.isatty() and sys.stdout.isatty():
        from specchat.ui.app import run_tui

        run_tui(config, sampling, spec, system)  # loads the model itself, behind a progress screen
        return
    engine = Engine.load(config, progress=StderrProgress())
    plain_repl(engine, sampling, spec, system)


def register(group: click.Group) -> None:
    group.add_command(run)
