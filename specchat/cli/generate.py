"""`specchat generate`: complete prompts, streaming text or printing one JSON object per prompt.

A prompt comes from --prompt, from stdin, or from --prompts-file (one prompt per line, or a .jsonl file of
{"prompt": ...} / {"messages": [...]} objects). A file's prompts run concurrently and fail one by one: a line
that cannot be read, does not fit the context or cannot get KV pages gets its own record with
`finish_reason: "error"` and the line in its message, the others complete, and the exit status is 1 if any failed.

Streamed text ends with a timing line on stderr (when stderr is a terminal, or with --stats), as llama-cli and
`ollama run --verbose` print: prompt tokens, time to first token, decode tok/s and, when something drafts,
tokens per step and acceptance. Time to first token is the request's time less its decoding time (first token to
last; `Finished.decode_s`), so the prefill and any wait for a slot never dilute the decode rate.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from specchat.cli.inputs import PromptItem, check_flag_text, check_stdout, read_prompts
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
from specchat.engine.sequence import Finished, TextDelta
from specchat.engine.stats import SpecStats
from specchat.errors import PromptError, SpecchatError

FAILED_LINES_SHOWN = 10  # the summary of failed prompts names at most this many lines


def time_to_first_token(fin: Finished) -> float:
    """Seconds from submission to the request's first token (engine.telemetry's TTFT): its time less its decoding
    time, since the Finished event comes in the step of the last token."""
    return max(fin.elapsed_s - fin.decode_s, 0.0)


def memory_json(engine, dtype: str) -> dict:
    """engine.memory(), with unquantized weights named by the model dtype ("float32"): quant.handler says "bf16"
    for every unquantized form."""
    from specchat.engine.api import named_weights  # imports torch: not for `specchat --help`

    return named_weights(engine.memory(), dtype)


def result_json(memory: dict, model_name: str, fin: Finished) -> dict:
    """The --json record of one finished request (field names are an interface: add, never rename)."""
    stats = {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": len(fin.token_ids),
        "tok_per_s": round(fin.tok_per_s, 3),
        "ttft_s": round(time_to_first_token(fin), 4),
        "decode_s": round(fin.decode_s, 4),
        **fin.stats.to_json(),
        "memory": memory,
    }
    out = {"model": model_name, "text": fin.text, "token_ids": fin.token_ids, "finish_reason": fin.reason}
    if fin.error:
        out["error"] = fin.error
    out["stats"] = stats
    return out


def failed(error: str) -> Finished:
    """The Finished record of a prompt that never reached the engine."""
    return Finished(
        request_id=-1,
        reason="error",
        text="",
        token_ids=[],
        prompt_tokens=0,
        stats=SpecStats(),
        elapsed_s=0.0,
        decode_s=0.0,
        error=error,
    )


def with_system(prompt: str | list[dict], system: str | None) -> str | list[dict]:
    """Chat messages get --system in front unless they open with a system message of their own."""
    if system is None or isinstance(prompt, str) or prompt[0]["role"] == "system":
        return prompt
    return [{"role": "system", "content": system}, *prompt]


def submit_all(engine, items: list[PromptItem], sampling, spec, system, raw, from_file: bool) -> list:
    """A RequestHandle per prompt, or the Finished error of a prompt the engine refused (the others still run):
    with --json each gets its record, and any failure ends the command in one error line after them."""
    submitted = []
    for item in items:
        if item.prompt is not None and raw and not isinstance(item.prompt, str):
            item.error = "--raw takes text prompts, this line has messages"
        if item.error is not None:
            submitted.append(failed(item.error))
            continue
        try:
            own = sampling if item.max_tokens is None else dataclasses.replace(sampling, max_tokens=item.max_tokens)
            submitted.append(engine.submit(with_system(item.prompt, system), own, spec, system=system, raw=raw))
        except PromptError as exc:  # a file's prompt is named by its line later; --prompt or stdin here
            submitted.append(failed(str(exc) if from_file else f"{item.where}: {exc}"))
    return submitted


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a JSON request ran: `partial` is its record so far (finish_reason "cancelled")."""

    def __init__(self, partial: Finished) -> None:
        super().__init__()
        self.partial = partial


def wait(request, as_json: bool) -> Finished:
    """A request's Finished event, its text streamed to stdout on the way unless the output is JSON."""
    if isinstance(request, Finished):
        return request
    return collect(request) if as_json else stream(request)


def collect(handle) -> Finished:
    """A request's Finished event, for JSON output. Ctrl-C cancels it and raises Interrupted with the text and
    tokens it had (streamed output keeps them on the screen; JSON output had printed nothing)."""
    text: list[str] = []
    ids: list[int] = []
    try:
        for event in handle.events():
            if isinstance(event, TextDelta):
                text.append(event.text)
                ids.extend(event.token_ids)
            elif isinstance(event, Finished):
                return event
    except KeyboardInterrupt:
        handle.cancel()
        partial = failed("interrupted (Ctrl-C)")
        raise Interrupted(dataclasses.replace(partial, reason="cancelled", text="".join(text), token_ids=ids)) from None
    raise AssertionError("a request's events end with Finished")


def stream(handle) -> Finished:
    """Print a request's text as it comes, then end its line (not for a request that failed before any text: its
    error is the only output)."""
    wrote = False
    for event in handle.events():
        if isinstance(event, TextDelta) and event.text:
            click.echo(event.text, nl=False)
            wrote = True
        elif isinstance(event, Finished):
            if wrote or event.error is None:
                click.echo()
            return event
    raise AssertionError("a request's events end with Finished")


def timing_line(fin: Finished, drafter: str) -> str:
    """What one answer took, in one line: prompt, time to first token, decode rate, and the speculation."""
    s, n = fin.stats, len(fin.token_ids)
    parts = [f"prompt {fin.prompt_tokens} tokens", f"first token {time_to_first_token(fin) * 1e3:.0f} ms"]
    if n > 1:
        parts.append(f"{n} tokens in {fin.decode_s:.2f} s, {fin.tok_per_s:.1f} tok/s")
    else:  # the decode rate is over the gaps after the first token: with one token or none there is none to time
        parts.append(f"{n} token{'' if n == 1 else 's'}")
    if s.drafted:
        parts.append(f"{s.tokens_per_step:.2f} tokens/step, {s.acceptance_rate:.0%} of {s.drafted} drafts accepted")
    parts.append(f"drafter {drafter}")
    return f"[{' · '.join(parts)}]"


def check_all_succeeded(items: list[PromptItem], results: list[Finished], prompts_file: Path | None) -> None:
    """One error line (so exit status 1) if any prompt failed: its reason, or which lines of the file."""
    bad = [item for item, fin in zip(items, results, strict=True) if fin.reason == "error"]
    if not bad:
        return
    if len(items) == 1:
        raise SpecchatError(results[0].error or "the request failed")
    lines = ", ".join(item.where.removeprefix("line ") for item in bad[:FAILED_LINES_SHOWN])
    more = f" and {len(bad) - FAILED_LINES_SHOWN} more" if len(bad) > FAILED_LINES_SHOWN else ""
    label = "line" if len(bad) == 1 else "lines"
    raise SpecchatError(f"{len(bad)} of {len(items)} prompts in {prompts_file} failed ({label} {lines}{more})")


@click.command()
@model_options
@tp_option
@click.option("--prompt", "-p", help="the prompt text (default: read from stdin)")
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help='one prompt per line; a .jsonl file: one {"prompt": "..."} or {"messages": [...]} per line',
)
@click.option("--system", help="system message (chat template only)")
@click.option("--raw", is_flag=True, help="tokenize the prompt as is, without the chat template")
@sampling_options
@click.option(
    "--stop",
    multiple=True,
    help="end the answer where this text appears, leaving it out (repeatable; as the API's `stop`)",
)
@spec_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object per prompt instead of streaming text")
@click.option(
    "--stats/--no-stats",
    default=None,
    help="a timing line on stderr after each streamed answer (default: when stderr is a terminal; with --json "
    'each record carries the figures under "stats" instead)',
)
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
    stop,
    drafter,
    k,
    as_json,
    stats,
) -> None:
    """Complete a prompt (or a file of prompts, run concurrently) with MODEL (default: smollm2-135m)."""
    from specchat.engine.drafters.base import default_drafter_name
    from specchat.engine.engine import Engine

    if raw and system is not None:
        raise click.UsageError("--system goes into the chat template, which --raw skips: give one or the other")
    check_stdout()
    for flag, text in [("--system", system), *(("--stop", text) for text in stop)]:
        check_flag_text(flag, text)
    items = read_prompts(prompt, prompts_file)
    sampling = sampling_params(
        stop, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    spec = spec_params(drafter, k)
    config = engine_config(model, device, dtype, weights=weights)
    engine = Engine.load(config, progress=StderrProgress())
    if spec.drafter == "default":  # named, for the timing line (the default may depend on the device)
        spec = dataclasses.replace(spec, drafter=default_drafter_name(engine))
    engine.drafter(spec.drafter)  # a drafter that cannot load fails once, not once per prompt
    model_dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    show_timing = not as_json and (stats if stats is not None else sys.stderr.isatty())
    from_file = prompts_file is not None
    submitted = submit_all(engine, items, sampling, spec, system, raw, from_file)
    results = []
    for i, (item, request) in enumerate(zip(items, submitted, strict=True)):
        if not as_json and len(items) > 1:
            click.echo(f"--- prompt {i + 1} ---")
        try:
            fin = wait(request, as_json)
        except Interrupted as stop:  # the answer so far as a record, then exit 130 as any Ctrl-C does
            click.echo(json.dumps(result_json(memory_json(engine, model_dtype), config.model, stop.partial)))
            raise KeyboardInterrupt from None
        if fin.error and from_file:
            fin = dataclasses.replace(fin, error=f"{item.where}: {fin.error}")
        if as_json:
            click.echo(json.dumps(result_json(memory_json(engine, model_dtype), config.model, fin)))
        elif fin.error and len(items) > 1:
            click.echo(f"specchat: {fin.error}", err=True)  # the error names the line
        elif show_timing and not fin.error:
            click.echo(timing_line(fin, spec.drafter), err=True)
        results.append(fin)
    check_all_succeeded(items, results, prompts_file)


def register(group: click.Group) -> None:
    group.add_command(generate)
