"""`specchat agent SCRIPT`: run an agent script's tasks on the engine, in the TUI or as a headless trace / JSONL."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from specchat.cli.options import DTYPE_HELP, StderrProgress, check_drafter_arg, k_flag
from specchat.config import DEVICES, DRAFTER_SYNTAX, DTYPE_CHOICES, KV_CHOICES, WEIGHT_CHOICES, EngineConfig
from specchat.errors import ConfigError, SpecchatError

TUI_MODULE = "specchat.ui.agent"  # the TUI's agent view, when it has one
TUI_ENTRY = "run_agent_app"  # run_agent_app(script, config, concurrency) -> None


def tui_launcher() -> Callable | None:
    """The TUI's agent view entry point, or None while the UI has none."""
    if importlib.util.find_spec("specchat.ui") is None or importlib.util.find_spec(TUI_MODULE) is None:
        return None
    return getattr(importlib.import_module(TUI_MODULE), TUI_ENTRY, None)


def run_headless(script, config: EngineConfig, concurrency: int | None, as_json: bool) -> list:
    """Load the engine, run every task, print a readable trace (or JSONL events) on stdout; the runs' outcomes."""
    from specchat.agent.tools import check_confirm

    try:
        check_confirm(script.tools, None)  # nobody to ask: before the model loads, naming the script
    except ConfigError as error:
        raise ConfigError(f"{script.path}: {error}") from None
    with second_interrupt_kills():
        return _run_headless(script, config, concurrency, as_json)


def _run_headless(script, config: EngineConfig, concurrency: int | None, as_json: bool) -> list:
    from specchat.agent.runner import AgentSession
    from specchat.agent.trace import JsonlWriter, TracePrinter
    from specchat.engine.engine import Engine

    engine = Engine.load(config, progress=StderrProgress())
    session = AgentSession(engine, script, concurrency)
    if session.warning:
        click.echo(f"specchat: warning: {session.warning}", err=True)
    sink = TraceSink(JsonlWriter(sys.stdout) if as_json else TracePrinter(sys.stdout), session)
    engine.start()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # a tool's print() goes to stderr: stdout is the trace's
            outcomes = session.run(sink.write)
    finally:
        engine.close()
    sink.check()
    return outcomes


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, a cancelled CI job, `kill`) while the runs go: they stop as for Ctrl-C, their processes
    killed and their run_end events ("cancelled") written, where the process ended at once, without a word."""


TERMINATED_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended


@contextlib.contextmanager
def second_interrupt_kills() -> Iterator[None]:
    """The first Ctrl-C (or SIGTERM) stops the runs (KeyboardInterrupt: exit 130; Terminated: exit 143); a second
    signal while they wind down (the engine closing, torch's exit hooks) ends the process at once, where it raised
    KeyboardInterrupt inside those hooks and printed their traceback. A signal that is not Python's default here
    (SIGINT ignored in a background job, say) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    ours = [number for number, default in defaults.items() if signal.getsignal(number) is default]

    def interrupt(signum: int, frame: object) -> None:
        for number in ours:
            signal.signal(number, signal.SIG_DFL)
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    for number in ours:
        signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number in ours:
            if signal.getsignal(number) is interrupt:  # no signal came: as it was
                signal.signal(number, defaults[number])


class TraceSink:
    """The trace's writer, guarded: once stdout fails (a full disk, a pipe whose reader has gone), the runs are
    stopped and the failure is raised after them, where it was an OSError in a run's thread and a traceback."""

    def __init__(self, writer, session) -> None:
        self.writer = writer
        self.session = session
        self.failure: OSError | None = None

    def write(self, event) -> None:
        if self.failure is not None:
            return
        try:
            self.writer.write(event)
        except OSError as error:
            self.failure = error
            self.session.cancel()  # nobody reads what the runs do
            if not isinstance(error, BrokenPipeError):
                from specchat.cli import discard

                discard(self.writer.stream)

    def check(self) -> None:
        """Raise the failure to write, if there was one: as one line, or, for a pipe whose reader quit (`| head`),
        the BrokenPipeError itself, which the CLI ends quietly with status 141 as for every command."""
        if self.failure is None:
            return
        if isinstance(self.failure, BrokenPipeError):
            raise self.failure
        why = self.failure.strerror or self.failure
        raise SpecchatError(f"cannot write the trace to stdout: {why}; the runs were stopped")


def check_outcomes(outcomes: list) -> None:
    """A job's exit status says whether its runs worked: runs that ended in an engine error fail the command
    (after the whole trace), so a script in CI or cron does not pass on a broken run. Runs that reached their
    step or time limit without an answer are results, not failures."""
    failed = sum(outcome.reason == "error" for outcome in outcomes)
    if failed:
        raise SpecchatError(f"{failed} of {len(outcomes)} runs ended in an error (see the trace above)")


def on_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


@click.command()
@click.argument("script_path", metavar="SCRIPT", type=click.Path(path_type=Path))
@click.option("--headless", is_flag=True, help="print a readable trace instead of showing the runs in the TUI")
@click.option("--json", "as_json", is_flag=True, help="write one JSON event per line to stdout (implies --headless)")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="runs in flight at once [script's]")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None, help=DTYPE_HELP)
@click.option("--drafter", default=None, help=f"override the script's drafter: {DRAFTER_SYNTAX}")
@click.option("--k", "k", default=None, help="override the script's draft tokens per step, or 'auto'")
@click.option("--weights", type=click.Choice(WEIGHT_CHOICES), default=None, help="override the script's weights")
@click.option("--kv", "kv", type=click.Choice(KV_CHOICES), default=None, help="override the script's KV page format")
def agent(
    script_path: Path,
    headless: bool,
    as_json: bool,
    concurrency: int | None,
    device: str,
    dtype: str | None,
    drafter: str | None,
    k: str | None,
    weights: str | None,
    kv: str | None,
) -> None:
    """Run the tasks of an agent SCRIPT (TOML; see docs/agents.md), several at once, with tools."""
    from specchat.agent.script import k_bound_error, load_script

    if sys.stdout is None:  # started with stdout closed (>&-): no trace, and no terminal for the TUI
        raise SpecchatError("stdout is closed: the runs' trace has nowhere to go")
    script = load_script(script_path)
    if drafter is not None:
        check_drafter_arg(drafter)  # the script's own drafter is the script's: a missing file runs without it
    if drafter is not None or k is not None:
        current = script.speculation
        try:
            override = dataclasses.replace(
                current, drafter=drafter or current.drafter, k=current.k if k is None else k_flag(k)
            )  # the script's k_max kept
        except ConfigError as error:
            if error.field != "k":
                raise
            raise k_bound_error("--k", error, current.k_max, script.path.name) from None
        script = dataclasses.replace(script, speculation=override)
    script = dataclasses.replace(script, weights=weights or script.weights, kv=kv or script.kv)
    config = EngineConfig(model=script.model, device=device, dtype=dtype, weights=script.weights, kv_format=script.kv)
    if not headless and not as_json and not on_terminal():
        # The TUI would wait for Ctrl+Q after the runs: a job without a terminal (cron, CI, a pipe) never ended.
        click.echo("specchat: not a terminal: printing the trace (as --headless)", err=True)
        headless = True
    if not headless and not as_json:
        launch = tui_launcher()
        if launch is not None:
            launch(script, config, concurrency)
            return
        click.echo("specchat: the TUI has no agent view yet; printing the trace instead", err=True)
    try:
        check_outcomes(run_headless(script, config, concurrency, as_json))
    except Terminated:
        click.echo("specchat: terminated (SIGTERM)", err=True)
        sys.exit(TERMINATED_STATUS)


def register(group: click.Group) -> None:
    group.add_command(agent)
