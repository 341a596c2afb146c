"""The `specchat` command: a click group whose subcommands live one per module."""

from __future__ import annotations

import sys

import click

from specchat.errors import SpecchatError

USAGE_EXIT = 2  # click's status for a bad flag or argument


def one_line(message: str) -> str:
    """A message folded onto one line (a library's error text may span several)."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


class Group(click.Group):
    """Turns every user-caused error into one line on stderr and a nonzero exit; our bugs keep tracebacks.

    Click's own usage errors (an unknown flag, a value of the wrong type, a missing file) get the same one line,
    naming the flag, instead of the usage text plus a hint plus the error.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecchatError as exc:
            click.echo(f"specchat: error: {one_line(str(exc))}", err=True)
            sys.exit(1)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            click.echo(f"specchat: error: {one_line(exc.format_message())} (see `{command} -h`)", err=True)
            sys.exit(USAGE_EXIT)
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specchat")
def main() -> None:
    """Chat with and run agents on open-weight models: speculative decoding + MXFP4, shown live."""


def _register() -> None:
    from specchat.cli import agent, bench, generate, models, perplexity, quantize, run, serve, train_heads

    for module in (agent, bench, generate, models, perplexity, quantize, run, serve, train_heads):
        module.register(main)


_register()
