"""The `specchat` command: a click group whose subcommands live one per module."""

from __future__ import annotations

import errno
import os
import stat
import sys

from specchat.registry import cache_dir


def keep_bytecode() -> None:
    """Under PYTHONDONTWRITEBYTECODE (set in many container images) every start compiles torch's Python sources
    again: `import torch` took 5 s instead of 2 on the lent H200, most of a GPU chat's start. Unless the user chose a
    place for bytecode (PYTHONPYCACHEPREFIX) or set SPECCHAT_NO_PYCACHE, keep it under $SPECCHAT_HOME/pycache:
    nothing is written next to the sources, which is what that setting is usually for, and the next start reads it."""
    if sys.dont_write_bytecode and sys.pycache_prefix is None and not os.environ.get("SPECCHAT_NO_PYCACHE"):
        sys.pycache_prefix = str(cache_dir() / "pycache")
        sys.dont_write_bytecode = False


keep_bytecode()  # before the commands' modules import torch

import click  # noqa: E402

from specchat.errors import SpecchatError  # noqa: E402

USAGE_EXIT = 2  # click's status for a bad flag or argument


def one_line(message: str) -> str:
    """A message folded onto one line (a library's error text may span several)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


NO_BREAK_HYPHEN = "\u2011"  # stands in for "-" while help text wraps, so draft-model never splits at its hyphen


class HelpFormatter(click.HelpFormatter):
    """Click's help layout, but wrapped at spaces only: names such as `draft-model` or `--max-tokens` stay whole."""

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = [(term, text.replace("-", NO_BREAK_HYPHEN)) for term, text in rows]
        super().write_dl(rows, col_max, col_spacing)

    def getvalue(self) -> str:
        return super().getvalue().replace(NO_BREAK_HYPHEN, "-")


class Context(click.Context):
    formatter_class = HelpFormatter


def report(exc: BaseException, ctx: click.Context) -> int | None:
    """A user-caused error as one line on stderr, and the exit status it ends with; None for our bugs (which keep
    their tracebacks)."""
    if isinstance(exc, SpecchatError):
        click.echo(f"specchat: error: {one_line(str(exc))}", err=True)
        return 1
    if isinstance(exc, click.UsageError):
        command = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
        click.echo(f"specchat: error: {one_line(exc.format_message())} (see `{command} -h`)", err=True)
        return USAGE_EXIT
    if isinstance(exc, ModuleNotFoundError):
        package = (exc.name or "specchat").split(".")[0]
        if package == "specchat":
            return None  # our own module (or an unnamed one): a bug, keep its traceback
        click.echo(
            f"specchat: error: the Python package {package!r} is missing (specchat needs it here); install it, "
            f"or reinstall specchat with its dependencies",
            err=True,
        )
        return 1
    if isinstance(exc, KeyboardInterrupt):  # (on a line of its own: the terminal's ^C, a progress line end there)
        click.echo("\nspecchat: interrupted", err=True)
        return 130
    return None


def stdout_closed() -> bool:
    """True where stdout is a pipe whose reader has gone (`| head -1` after its line): a BrokenPipeError from
    anything else (a tool's subprocess, a socket) is not ours to explain. Without poll (Windows) it is assumed."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.__stdout__.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def stdout_full() -> bool:
    """Whether stdout is where a write fails for room: /dev/full, or a file on a filesystem with no free blocks (a
    full disk's ENOSPC from another file, a checkpoint or a trace, is not stdout's to report)."""
    try:
        descriptor = sys.__stdout__.fileno()
        info = os.fstat(descriptor)
        if stat.S_ISCHR(info.st_mode):
            return info.st_rdev == os.makedev(1, 7)  # /dev/full
        if stat.S_ISREG(info.st_mode):
            room = os.fstatvfs(descriptor)
            return room.f_bavail == 0 or room.f_bfree == 0
    except (OSError, ValueError, AttributeError):
        pass
    return False


def report_failed_write(exc: OSError) -> int:
    """Output redirected to a full disk or /dev/full (`stdout_full`) is one line and status 1; what stdout still
    buffers goes where it can, else nowhere (`discard`), so that the interpreter's flush at exit does not fail again."""
    click.echo(f"specchat: cannot write the output: {exc.strerror}", err=True)
    try:
        sys.__stdout__.flush()
    except (OSError, ValueError):
        discard(sys.__stdout__)
    return 1


def report_closed_stdout() -> int:
    """Output cut short by a reader that quit (`| head -1`) ends quietly, as `git log | head -1` or `cat | head -1`
    do: the reader chose to stop, nothing failed. Stdout is pointed at /dev/null so that the interpreter's own
    flush at exit does not fail again, and the status is 141, what a shell reports for a process that SIGPIPE ended
    (so `set -o pipefail` scripts see it as they see other tools')."""
    discard(sys.__stdout__)
    return 128 + 13  # SIGPIPE


def discard(stream) -> None:
    """Point a failed stream's file descriptor (stdout's) at /dev/null, so that what is still buffered for it
    flushes at exit without a second error ("Exception ignored ... BrokenPipeError")."""
    try:
        descriptor = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, descriptor)
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stream)
        pass


_EXIT_STATUS = [1]  # the status the command ends with, for exit hooks that must end the process themselves


def exit_status() -> int:
    """The status the command is exiting with: 0 once it returned, what `report` chose for the user error that
    ended it, else 1 (a bug's traceback)."""
    return _EXIT_STATUS[0]


class Group(click.Group):
    """Turns every user-caused error into one line on stderr and a nonzero exit; our bugs keep tracebacks. A
    third-party package missing from a broken install (gguf, textual, ...) is such an error too.

    Click's own usage errors (an unknown flag, a value of the wrong type, a missing file) get the same one line,
    naming the flag, instead of the usage text plus a hint plus the error.
    """

    context_class = Context

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
            _EXIT_STATUS[0] = 0
            return result
        except (SpecchatError, click.UsageError, ModuleNotFoundError, KeyboardInterrupt) as exc:
            code = report(exc, ctx)
            if code is None:
                raise
            _EXIT_STATUS[0] = code
            sys.exit(code)
        except BrokenPipeError:
            if not stdout_closed():
                raise
            _EXIT_STATUS[0] = report_closed_stdout()
            sys.exit(_EXIT_STATUS[0])
        except OSError as exc:
            if exc.errno != errno.ENOSPC or exc.filename is not None or not stdout_full():
                raise
            _EXIT_STATUS[0] = report_failed_write(exc)
            sys.exit(_EXIT_STATUS[0])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with the whole first sentence of its help (click cuts it to the terminal's width with
        "...", which hid what most commands do); a long one wraps under itself."""
        rows = [
            (name, command.get_short_help_str(limit=sys.maxsize))
            for name in self.list_commands(ctx)
            if (command := self.get_command(ctx, name)) is not None and not command.hidden
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


HELP_WIDTH = 120  # help text uses the terminal's width up to this many columns (click's default stops at 80)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": HELP_WIDTH})
@click.version_option(package_name="specchat")
def main() -> None:
    """Chat with and run agents on open-weight models: speculative decoding + MXFP4, shown live."""


def _register() -> None:
    from specchat.cli import agent, bench, generate, models, perplexity, quantize, run, serve, train_heads

    for module in (agent, bench, generate, models, perplexity, quantize, run, serve, train_heads):
        module.register(main)
    for command in main.commands.values():
        command.context_class = Context


_register()
