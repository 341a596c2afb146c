"""`specchat run`: chat with a model. `--plain` is a streaming REPL on stdin/stdout (no TUI).

Settings come from the flags, then $SPECCHAT_HOME/config.toml (cli/defaults.py), then the built-in defaults.

Both take input at once and load the model meanwhile: the TUI behind a notice, the REPL in a thread while it
reads the first message (which waits for the model if it comes first, so nothing typed is lost). Speculation
follows the model's models.toml `drafter` unless --drafter says otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import click

from specchat.cli import exit_status
from specchat.cli.defaults import apply_defaults, load_defaults
from specchat.cli.inputs import check_flag_text, check_stdout, is_non_utf8
from specchat.cli.options import (
    StderrProgress,
    engine_config,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
    spec_params,
    tp_option,
)
from specchat.config import DRAFTER_SYNTAX, EngineConfig, SamplingParams, SpecParams, check_drafter_name
from specchat.errors import ConfigError, ContextLengthError, PromptError, SpecchatError

REPL_HELP = f"""\
Type a message and press Enter (end a line with \\ to continue it); Ctrl-C stops an answer.
  /help          this help
  /k N|auto      draft tokens per step
  /drafter NAME  {DRAFTER_SYNTAX}
  /clear         start the conversation afresh
  /quit          leave (so does Ctrl-D)
A line that starts with / is a command; start it with // to send it as a message."""


def read_message() -> str | None:
    """One user message from stdin (None at end of input); a trailing backslash continues the line.

    Bytes that are not UTF-8 end the chat in one error line (PromptError), whatever the locale's decoding does.
    """
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors != "surrogateescape":
        sys.stdin.reconfigure(errors="surrogateescape")  # undecodable bytes arrive as lone surrogates, refused below
    lines = []
    while True:
        try:
            line = ask("> " if not lines else ". ")
        except EOFError:
            return "\n".join(lines) if lines else None
        except KeyboardInterrupt:  # at a terminal, Ctrl-C drops the line being typed, as a shell does: a second
            if not stdin_is_terminal():  # Ctrl-C meant for an answer that had just ended left the chat, conversation
                raise  # and all (piped messages: it stops the command, exit 130)
            click.echo("\n(Ctrl-D or /quit leaves)", err=True)
            lines = []
            continue
        if is_non_utf8(line):
            raise PromptError("stdin: the message is not valid UTF-8")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def ask(prompt: str) -> str:
    """input() with its prompt where a person reads it, never among the answers on stdout (a file or a pipe of
    them): none when stdin is not a terminal (piped messages), on stderr when only stdout is redirected. A closed
    stdin (`<&-`) is the end of input."""
    if sys.stdin is None:
        raise EOFError
    if not sys.stdin.isatty():
        return input()
    if sys.stdout.isatty():
        return input(prompt)  # readline's own prompt, which line editing redraws
    click.echo(prompt, err=True, nl=False)
    return input()


class LoadProgress:
    """The loader's progress on stderr, silent until someone waits for the model (it would garble typing)."""

    def __init__(self) -> None:
        self.bar = StderrProgress()
        self.shown = threading.Event()

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.shown.is_set():
            self.bar(what, done, total)


def load_in_background(config: EngineConfig, progress: LoadProgress) -> Future:
    """Load the engine in a daemon thread (leaving before it is ready does not wait for it: see
    leave_while_loading)."""
    from specchat.engine.engine import Engine

    loading: Future = Future()

    def load() -> None:
        try:
            loading.set_result(Engine.load(config, progress=progress))
        except BaseException as exc:  # handed to the thread that waits: user errors become one line there
            loading.set_exception(exc)

    threading.Thread(target=load, name="specchat-load", daemon=True).start()
    leave = leave_while_loading(loading)
    atexit.register(leave)
    loading.add_done_callback(lambda _: atexit.unregister(leave))
    return loading


@dataclass(slots=True)
class PlainChat:
    """The REPL's state: the engine (loading until it is ready), the conversation and its settings."""

    loading: Future
    progress: LoadProgress
    sampling: SamplingParams
    spec: SpecParams
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    sent: int = 0  # messages sent to the model (not those Ctrl-C stopped before they reached it)
    failed: int = 0  # of them, those whose answer ended in an error (refused at submit, or ended by the engine)

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def engine(self):
        """The engine, waiting for it (with the progress bar) if it is still loading."""
        if not self.loading.done():
            click.echo("(waiting for the model…)", err=True)
            self.progress.shown.set()
        return self.loading.result()

    def command(self, line: str) -> bool:
        """Run a /command; False to quit. A user's mistake is one line, and the REPL goes on."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        if name in ("quit", "exit"):
            return False
        try:
            if name == "help":
                click.echo(REPL_HELP, err=True)
            elif name in ("clear", "reset"):
                self.clear()
                click.echo("(conversation cleared)", err=True)
            elif name == "k":
                if arg:
                    self.spec = repl_k(self.spec, arg)
                click.echo(f"(k {'auto' if self.spec.k is None else self.spec.k})", err=True)
            elif name == "drafter":
                if arg:
                    self.engine().drafter(repl_drafter(arg))  # built now: a missing file fails here
                    self.spec = replace(self.spec, drafter=arg)
                click.echo(f"(drafter {self.spec.drafter})", err=True)
            else:
                click.echo(f"unknown command /{name}: /help lists them", err=True)
        except SpecchatError as exc:  # a bad value, a drafter's file or model that does not load
            click.echo(f"error: {exc}", err=True)
        return True

    def send(self, text: str) -> None:
        """Stream the answer to one message; Ctrl-C stops it and keeps the conversation. An answer the engine ended
        in an error (the KV cache full, say) is shown with the error and left out of the conversation, so the next
        message is sent without it."""
        from specchat.engine.sequence import Finished, TextDelta

        try:
            engine = self.engine()
        except KeyboardInterrupt:  # Ctrl-C while the answer waits for the model: it stops that answer, as below
            self.progress.shown.clear()  # (the load goes on, quietly again while the next message is typed)
            click.echo("\n[stopped]", err=True)
            return
        try:
            handle = engine.submit([*self.messages, {"role": "user", "content": text}], self.sampling, self.spec)
        except KeyboardInterrupt:  # Ctrl-C just after Enter, while a long conversation is encoded (30-120 ms at 6k
            # tokens): it stops this answer before it starts, as above; the chat goes on
            click.echo("\n[stopped]", err=True)
            return
        except SpecchatError as exc:  # a prompt too long for the context, say: the conversation is unchanged (with
            # earlier turns, the hint says the "prompt" is the whole conversation and how to go on)
            grown = isinstance(exc, ContextLengthError) and any(m["role"] != "system" for m in self.messages)
            hint = "; the conversation so far is part of it: /clear starts a new one" if grown else ""
            click.echo(f"error: {exc}{hint}", err=True)
            self.sent, self.failed = self.sent + 1, self.failed + 1
            return
        self.sent += 1
        reply, error = "", None
        try:
            for event in handle.events():
                if isinstance(event, TextDelta):
                    reply += event.text
                    click.echo(event.text, nl=False)
                elif isinstance(event, Finished):
                    reply, error = event.text, event.error
                    s = event.stats
                    click.echo()  # the answer's line ends on stdout, which may be a file of answers
                    n = len(event.token_ids)  # (a decode rate needs a gap after the first token: one token has none)
                    rate = f"{event.tok_per_s:.1f} tok/s, " if n > 1 else ""
                    click.echo(
                        f"[{n} token{'' if n == 1 else 's'}, {rate}{s.tokens_per_step or 1:.2f} tokens/step, "
                        f"{event.reason}]",
                        err=True,
                    )
        except KeyboardInterrupt:
            handle.cancel()
            handle.result()
            click.echo()
            click.echo("[stopped]", err=True)
        if error is not None:
            click.echo(f"error: {error} (this message and its answer are left out of the conversation)", err=True)
            self.failed += 1
            return
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def repl_k(spec: SpecParams, text: str) -> SpecParams:
    """`spec` with the k of `/k TEXT`; a bad value is a ConfigError naming /k (SpecParams names the bare field)."""
    if text == "auto":
        return replace(spec, k=None)
    try:
        k = int(text)
    except ValueError:
        raise ConfigError(f"/k must be an integer or 'auto', got {text!r}") from None
    try:
        return replace(spec, k=k)
    except ConfigError as error:
        raise (error.named("/k") if error.field == "k" else error) from None


def repl_drafter(name: str) -> str:
    """The drafter of `/drafter NAME`; an unknown one is a ConfigError naming /drafter."""
    try:
        return check_drafter_name(name)
    except ConfigError as error:
        raise error.named("/drafter") from None


def plain_repl(chat: PlainChat) -> None:
    """Read, stream, repeat, from the first moment: a message typed before the model is ready waits for it."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    click.echo("Type a message and press Enter; /help lists the commands.", err=True)
    while True:
        text = read_message()
        if text is None:
            return
        if text.startswith("/") and not text.startswith("//"):
            if not chat.command(text):
                return
            continue
        text = text.removeprefix("/")  # "//..." sends "/..."
        if text.strip():
            chat.send(text)


@click.command()
@model_options
@tp_option
@click.option("--system", help="system message (default: config.toml's system, else none)")
@click.option("--plain", is_flag=True, help="a plain streaming REPL instead of the TUI")
@sampling_options
@spec_options
def run(model, device, dtype, weights, system, plain, max_tokens, temperature, top_p, top_k, seed, drafter, k) -> None:
    """Chat with MODEL (default: smollm2-135m) in the TUI, speculation shown live; --plain for a plain REPL.

    Model, drafter, k, weights, KV, temperature, theme and system prompt default to what
    $SPECCHAT_HOME/config.toml sets (see docs/tui.md); a flag given here wins over the file.

    With messages piped in (stdin not a terminal) the exit status is 1 if any answer ended in an error.
    """
    from specchat.registry import resolve

    check_stdout()
    check_flag_text("--system", system)
    defaults = load_defaults()  # a mistake in the file ends here, in one line naming the key
    given = {"model": model, "drafter": drafter, "k": k, "weights": weights, "temperature": temperature}
    given = apply_defaults(click.get_current_context(), defaults, {**given, "system": system})
    sampling = sampling_params(
        max_tokens=max_tokens, temperature=given["temperature"], top_p=top_p, top_k=top_k, seed=seed
    )
    spec = spec_params(given["drafter"], given["k"])
    kv = {"kv_format": given["kv_format"]} if "kv_format" in given else {}
    config = engine_config(given["model"], device, dtype, weights=given["weights"], **kv)
    entry = resolve(config.model)  # a bad name ends here, in one line, before any window or load
    device = config.chosen_device
    if spec.drafter == "default" and (device is not None or not entry.default_drafter_varies()):
        spec = replace(spec, drafter=entry.default_drafter(device, config.tp))  # else the engine resolves it
    if not plain and stdin_is_terminal() and sys.stdout.isatty():
        from specchat.ui.app import run_tui

        run_tui(config, sampling, spec, given["system"], defaults.theme)  # loads the model itself, behind a notice
        return
    progress = LoadProgress()
    drafter = spec.drafter
    if drafter == "default":  # not resolved: it depends on the device the load picks
        drafter = f"default: {entry.default_drafter('cpu')} on the CPU, {entry.default_drafter('cuda')} on a GPU"
    click.echo(f"loading {entry.alias} (drafter {drafter}, k {'auto' if spec.k is None else spec.k})", err=True)
    chat = PlainChat(load_in_background(config, progress), progress, sampling, spec, given["system"])
    plain_repl(chat)
    if chat.failed and not stdin_is_terminal():  # a script piping messages in learns of failed answers (exit 1)
        raise SpecchatError(f"{chat.failed} of {chat.sent} messages ended in an error (each named above)")


def stdin_is_terminal() -> bool:
    """stdin is a terminal (a person types); False for a pipe, a file, or none at all (closed: `<&-`)."""
    return sys.stdin is not None and sys.stdin.isatty()


def leave_while_loading(loading: Future):
    """An exit hook for a chat that ends while the model still loads: Python's exit would tear the interpreter down
    under the loader thread, still in torch's native code, which aborts the process (exit 134) instead of ending the
    chat; this ends it at once with the status the command chose (cli.exit_status)."""

    def leave() -> None:
        if not loading.done():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_status())

    return leave


def register(group: click.Group) -> None:
    group.add_command(run)
