"""The `specchat` command: a click group whose subcommands live one per module."""

from __future__ import annotations

import sys

import click

from specchat.errors import SpecchatError


class Group(click.Group):
    """Turns every user-caused error into one line on stderr and a nonzero exit; our bugs keep tracebacks."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecchatError as exc:
            click.echo(f"specchat: error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specchat")
def main() -> None:
    """Chat with and run agents on open-weight models: speculative decoding + MXFP4, shown live."""


def _register() -> None:
    from specchat.cli import agent, bench, generate, models, perplexity, quantize, run, train_heads

    for module in (agent, bench, generate, models, perplexity, quantize, run, train_heads):
        module.register(main)


_register()
