"""`specchat generate`: complete prompts, streaming text or printing one JSON object per prompt."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specchat.cli.options import (
    StderrProgress,
    engine_config,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
    spec_params,
)
from specchat.engine.sequence import Finished, TextDelta
from specchat.errors import PromptError


def result_json(engine, model_name: str, fin: Finished) -> dict:
    """The --json record of one finished request (field names are an interface: add, never rename)."""
    stats = {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": len(fin.token_ids),
        "tok_per_s": round(fin.tok_per_s, 3),
        **fin.stats.to_json(),
        "memory": engine.memory(),
    }
    out = {"model": model_name, "text": fin.text, "token_ids": fin.token_ids, "finish_reason": fin.reason}
    if fin.error:
        out["error"] = fin.error
    out["stats"] = stats
    return out


def read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompts-file")
    if prompt is not None:
        return [prompt]
    prompts = [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise PromptError(f"{prompts_file}: no prompts (one per line)")
    return prompts


@click.command()
@model_options
@click.option("--prompt", "-p", help="the prompt text")
@click.option(
    "--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="one prompt per line"
)
@click.option("--system", help="system message (chat template only)")
@click.option("--raw", is_flag=True, help="tokenize the prompt as is, without the chat template")
@sampling_options
@spec_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per prompt instead of streaming text")
def generate(
    model,
    device,
    dtype,
    weights,
    prompt,
    prompts_file,
    system,
    raw,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    drafter,
    k,
    as_json,
) -> None:
    """Complete a prompt (or a file of prompts, run concurrently) with MODEL (default: smollm2-135m)."""
    from specchat.engine.engine import Engine

    prompts = read_prompts(prompt, prompts_file)
    sampling = sampling_params(max_tokens, temperature, top_p, top_k, seed)
    spec = spec_params(drafter, k)
    config = engine_config(model, device, dtype, weights=weights)
    engine = Engine.load(config, progress=StderrProgress())
    handles = [engine.submit(p, sampling, spec, system=system, raw=raw) for p in prompts]
    for i, handle in enumerate(handles):
        if as_json:
            click.echo(json.dumps(result_json(engine, config.model, handle.result())))
            continue
        if len(handles) > 1:
            click.echo(f"--- prompt {i + 1} ---")
        for event in handle.events():
            if isinstance(event, TextDelta) and event.text:
                click.echo(event.text, nl=False)
            elif isinstance(event, Finished):
                click.echo()
                if event.error:
                    click.echo(f"specchat: request failed: {event.error}", err=True)


def register(group: click.Group) -> None:
    group.add_command(generate)
