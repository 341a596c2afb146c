"""`specchat bench`: concurrent sessions on a real model, or decode/verify speed of a synthetic shape."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specchat.cli.inputs import read_prompt_lines
from specchat.cli.options import (
    DTYPE_HELP,
    StderrProgress,
    check_memory_ask,
    cpu_act_option,
    given_flags,
    model_argument,
    sampling_params,
    spec_params,
)
from specchat.config import DEVICES, DTYPE_CHOICES, KV_CHOICES, WEIGHT_CHOICES, WEIGHT_FORMATS, EngineConfig
from specchat.errors import ConfigError, PromptError
from specchat.registry import default_model

SYNTHETIC_WEIGHTS = (*WEIGHT_FORMATS, "int4")  # int4: gpt-fast's int4 g32 yardstick (specchat/bench/int4.py)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from specchat.bench.sessions import SessionsResult
    from specchat.bench.synthetic import SyntheticCase


def int_list(text: str, what: str, least: int = 0) -> list[int]:
    """A comma-separated list of integers >= least; an empty item ("1,,2", "1,") is refused, not skipped."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < least:
        raise ConfigError(f"{what} must list integers >= {least}, got {text!r}")
    return values


def print_table(headers: list[str], rows: list[list]) -> None:
    click.echo("| " + " | ".join(headers) + " |")
    click.echo("|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|")
    for row in rows:
        click.echo(
            "| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else "-" if v is None else str(v) for v in row) + " |"
        )


def median_run(results: Sequence[SessionsResult]) -> SessionsResult:
    """Of one configuration's runs, the one of median throughput (the lower middle of an even count)."""
    ordered = sorted(results, key=lambda r: r.tok_per_s)
    return ordered[(len(ordered) - 1) // 2]


def bench_sessions(
    config: EngineConfig, prompts_file, sessions, max_tokens, drafter, k, as_json, rounds=None, step_ahead="on",
    temperature=0.0, requests=None,
) -> None:  # fmt: skip
    """The grid of session counts x drafters (x steps ahead on / off), `rounds` times; of each configuration the
    run of median throughput over the rounds after the first is reported (with two rounds: the second): on a GPU
    the first round still meets first-time shapes (an eager prefill step beside drafting requests compiles its
    kernels once), and at 32 sessions one run of the default model takes ~130 ms, whose plain decoding varied by a
    quarter between calls. Before the rounds each configuration runs short and untimed (warm_configurations), so
    one round, the CPU's default, is timed warm too. Requests are greedy, or sampled at `temperature` (unseeded,
    as API clients send them); `requests` per run (default: the largest session count), the prompts cycled."""
    from specchat.bench.sessions import run_sessions
    from specchat.engine.engine import Engine

    prompts = read_prompt_lines(Path(prompts_file), "--prompts")
    counts = int_list(sessions, "--sessions", least=1)
    sampling = sampling_params(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    specs = [spec_params(name.strip(), k) for name in drafter.split(",")]
    modes = [{"on": True, "off": False}.get(m.strip()) for m in step_ahead.split(",")]
    if None in modes:
        raise ConfigError(f"--step-ahead takes on, off or both (on,off), got {step_ahead!r}")
    config = dataclasses.replace(config, max_running=max(config.max_running, *counts))  # N sessions run at once
    engine = Engine.load(config, progress=StderrProgress())
    check_sessions_fit(
        engine, prompts[: min(requests or max(counts), len(prompts))], max(counts), sampling.max_tokens, specs
    )
    modes = list(dict.fromkeys(m and engine.runner.overlaps for m in modes))  # nothing runs ahead without overlap
    # the graphs of every batch bucket and drafter's taps: none captured mid-run
    engine.warm_up(StderrProgress(), sessions=max(counts), drafters=[spec.drafter for spec in specs])
    requests = requests or max(counts)  # every count runs the same requests, so their throughputs compare
    warm_configurations(engine, prompts, specs, modes, sampling, min(requests, len(prompts)))
    runs = []  # per round, a result per (count, mode, drafter)
    for _ in range(rounds or (2 if engine.device.type == "cuda" else 1)):
        runs.append([])
        for n in counts:
            for mode in modes:
                engine.spec_step.runs_ahead = mode
                runs[-1] += [run_sessions(engine, prompts, n, sampling, spec, requests=requests) for spec in specs]
    engine.spec_step.runs_ahead = engine.runner.overlaps
    results = [median_run(same) for same in zip(*(runs[1:] or runs), strict=True)]
    if as_json:
        for r in results:
            click.echo(json.dumps(dataclasses.asdict(r)))
        return
    base = {}  # each drafter's (and mode's) first run at the first count: "vs N" of a count listed twice, too
    for r in results:
        if r.sessions == results[0].sessions:
            base.setdefault((r.drafter, r.step_ahead), r.tok_per_s)
    rows = [
        [
            r.sessions,
            r.requests,
            r.drafter if len(modes) == 1 else f"{r.drafter}{'' if r.step_ahead else ' (no step ahead)'}",
            "-" if r.k is None else r.k,
            r.tok_per_s,
            f"{r.tok_per_s / base[r.drafter, r.step_ahead]:.2f}x",
            r.itl_p50_ms,
            r.itl_p99_ms,
            r.ttft_p50_ms,
            r.acceptance_rate,
            r.tokens_per_step,
            r.kv_used_tokens_peak,
            cap_shares(r.gate_caps) if r.drafter != "none" else "-",
        ]
        for r in results
    ]
    headers = [
        "sessions",
        "requests",
        "drafter",
        "k",
        "tok/s",
        f"vs {results[0].sessions}",
        "ITL P50 ms",
        "ITL P99 ms",
        "TTFT P50 ms",
    ]
    print_table([*headers, "acceptance", "tokens/step", "KV tokens peak", "gate caps"], rows)
    if len(runs) > 2:  # each counted round, against the first configuration of its count in the same round
        click.echo("tok/s by round (the first left out; in brackets: against the first drafter, same round):")
        for i, r in enumerate(runs[1]):
            base_at = next(j for j, b in enumerate(runs[1]) if (b.sessions, b.step_ahead) == (r.sessions, r.step_ahead))
            each = [
                f"{run[i].tok_per_s:,.0f}"
                + (f" ({run[i].tok_per_s / run[base_at].tok_per_s:.2f}x)" if i != base_at else "")
                for run in runs[1:]
            ]
            mode = "" if len(modes) == 1 else f" (step ahead {'on' if r.step_ahead else 'off'})"
            click.echo(f"  {r.sessions} {r.drafter}{mode}: " + " / ".join(each))


def check_sessions_fit(engine, prompts: list[str], sessions: int, max_tokens: int, specs) -> None:
    """The KV cache must hold `sessions` requests at once, each its prompt, `max_tokens` answer tokens (bench
    ignores end of text) and a step's drafts: past it the scheduler preempted requests, so the row said N sessions
    of a run that never had N in flight (and `--sessions 99999999999` ended in a MemoryError)."""
    lengths = []
    for n, prompt in enumerate(prompts, 1):
        try:
            lengths.append(len(engine.encode_prompt(prompt)))
        except PromptError as exc:  # (one past the context: the message named no prompt)
            raise type(exc)(f"--prompts, prompt {n}: {exc}") from None
    longest, context = max(lengths), engine.model.cfg.max_position
    if longest + max_tokens > context:  # answers end at the context: fewer tokens than asked, said so
        click.echo(
            f"specchat: note: --max-tokens {max_tokens} after a prompt of {longest} tokens is past the model's "
            f"context ({context}): such answers stop there",
            err=True,
        )
    drafts = max(spec.k_max if spec.k is None else spec.k for spec in specs) + 1
    tokens = min(longest + max_tokens, context)
    fits = engine.pool.num_pages // engine.pool.pages_for(tokens + drafts)  # (the longest request's at its end)
    if sessions > fits:
        raise ConfigError(
            f"--sessions {sessions}: the KV cache holds {fits} such sessions at once (each up to {tokens} tokens: "
            f"its prompt and --max-tokens {max_tokens}); lower --sessions or --max-tokens"
        )


WARM_UP_REQUESTS = 2  # an untimed run of each configuration, before the timed rounds
WARM_UP_TOKENS = 4


def warm_configurations(engine, prompts: list[str], specs, modes, sampling, distinct: int) -> None:
    """Untimed, before the timed rounds, so that every timed run is warm whatever the round count: each of the
    `distinct` prompts the runs send is prefilled once (a later configuration found them in the prefix cache, the
    first did not), then each configuration runs WARM_UP_REQUESTS requests of WARM_UP_TOKENS tokens (its drafter
    built, its buffers allocated). On the CPU, where the bench runs one round, the first configuration was timed
    cold: `--drafter none,none,none` gave 12, 101 and 100 tok/s, the first's TTFT 2.3 s."""
    from specchat.bench.sessions import run_sessions

    short = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, WARM_UP_TOKENS))
    run_sessions(engine, prompts, distinct, dataclasses.replace(short, max_tokens=1), specs[0], requests=distinct)
    for mode in modes:
        engine.spec_step.runs_ahead = mode
        for spec in specs:
            run_sessions(engine, prompts, WARM_UP_REQUESTS, short, spec, requests=WARM_UP_REQUESTS)


def cap_shares(caps: dict[int, int]) -> str:
    """`k=share` of the gated steps at each cap the draft gates allowed ("-" where none was gated)."""
    total = sum(caps.values())
    return " ".join(f"{cap}={n / total:.0%}" for cap, n in caps.items()) if total else "-"


def synthetic_cases(
    weights: str, kv: str, batch: str, k: str, acceptance: tuple[float, ...], label: str
) -> list[SyntheticCase]:
    """Every combination of the comma lists, in run order (weight format outermost: one model per format)."""
    from specchat.bench.synthetic import SyntheticCase

    formats = [w.strip() for w in weights.split(",")]
    for fmt in formats:
        if fmt not in SYNTHETIC_WEIGHTS:
            raise ConfigError(f"--weights takes {', '.join(SYNTHETIC_WEIGHTS)} with --synthetic, got {fmt!r}")
    return [
        SyntheticCase(b, label if fmt == "bf16" else fmt, kv_fmt.strip(), kk, acceptance if kk else (0.0,))
        for fmt in formats
        for kv_fmt in kv.split(",")
        for b in int_list(batch, "--batch")
        for kk in int_list(k, "--k")
    ]


def acceptance_rates(text: str) -> tuple[float, ...]:
    """--acceptance: one rate, or per-position rates (SyntheticCase checks their range)."""
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ConfigError(f"--acceptance takes rates in [0, 1] (e.g. 0.8 or 0.53,0.75,0.86), got {text!r}") from None


def bench_synthetic(shape, device, batch, weights, kv, k, acceptance, context, steps, eager, as_json) -> None:
    import torch

    from specchat.bench.int4 import quantize_int4
    from specchat.bench.synthetic import (
        SHAPES,
        WARMUP_STEPS,
        estimate_bytes,
        quantize_all,
        random_model,
        run_case,
    )
    from specchat.engine.loading import make_runner, pick_device

    if shape not in SHAPES:
        raise ConfigError(f"unknown synthetic shape {shape!r} (available: {', '.join(SHAPES)})")
    if context < 1 or steps < 1:
        raise ConfigError(f"--context and --steps must be >= 1, got {context} and {steps}")
    acceptance = acceptance_rates(acceptance)
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cases = synthetic_cases(weights, kv, batch, k, acceptance, str(dtype).removeprefix("torch."))
    # a model of that shape runs no request past its context: the prompt, then k + 1 positions a step (warm-up too)
    reach = context + (WARMUP_STEPS + steps) * (max(c.k for c in cases) + 1)
    if reach > SHAPES[shape].max_position:
        raise ConfigError(
            f"--context {context} and --steps {steps}: the requests reach position {reach}, past the {shape} "
            f"shape's context of {SHAPES[shape].max_position} tokens (the prompt, then k + 1 tokens a step)"
        )
    check_memory_ask(estimate_bytes(SHAPES[shape], dtype, cases, context, steps), device, f"--synthetic {shape}")

    runner_factory = functools.partial(make_runner, eager=eager)
    results = []
    for fmt in dict.fromkeys(c.weights for c in cases):
        model = random_model(SHAPES[shape], dtype, dev)
        if fmt == "mxfp4":
            quantize_all(model)
        elif fmt == "int4":  # gpt-fast's int4 g32 through torch's tinygemm: the peer, in the same run
            quantize_int4(model)
        for case in (c for c in cases if c.weights == fmt):
            results.append(run_case(model, case, context, steps, runner_factory=runner_factory))
            click.echo(f"done: {case}", err=True)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if as_json:
        for r in results:
            click.echo(json.dumps(dataclasses.asdict(r)))
        return
    plain = {}  # each batch's first plain run (a batch listed twice compares with the first)
    for r in results:
        if r.case.k == 0:
            plain.setdefault((r.case.batch, r.case.weights, r.case.kv), r.tok_per_s)
    rows = []
    for r in results:
        c = r.case
        base = plain.get((c.batch, c.weights, c.kv))
        spec = f"k={c.k}, a={c.acceptance_label} (benchmark drafter)" if c.k else "plain"
        ratio = f"{r.tok_per_s / base:.2f}x" if base else "-"
        rows.append(
            [
                c.batch,
                c.weights,
                c.kv,
                spec,
                r.tok_per_s,
                r.tok_per_s / c.batch,
                r.step_ms,
                r.tokens_per_step,
                r.latency_p50_ms,
                r.latency_p99_ms,
                ratio,
                r.prefill_tok_per_s,
            ]
        )
    mode = "eager" if eager or dev.type != "cuda" else "fused kernels + CUDA graphs"
    click.echo(f"synthetic {shape}, {dev}, context {context}, {steps} steps, {mode}")
    headers = ["batch", "weights", "KV", "decoding", "tok/s", "tok/s per request", "step P50 ms", "tokens/step"]
    print_table([*headers, "P50 ms/token", "P99 ms/token", "vs plain", "prefill tok/s"], rows)


# Flags of one mode only (their parameter names); given to the other, they are refused rather than ignored.
SESSIONS_ONLY = ("dtype", "prompts_file", "max_tokens", "drafter", "rounds", "step_ahead", "temperature")
SYNTHETIC_ONLY = ("batch", "acceptance", "context", "steps")


@click.command()
@model_argument
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None, help=DTYPE_HELP)
@click.option("--sessions", default=None, help="comma-separated concurrent session counts, e.g. 1,8,32")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), help="one prompt per line")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--drafter", default="none", show_default=True, help="comma-separated drafters to compare")
@click.option("--k", "k", default=None, help="sessions: draft tokens or 'auto' (default 4); synthetic: list (0,4)")
@click.option(
    "--weights",
    default=None,
    help="sessions: auto (as the checkpoint stores them, as `run` loads it: the default) | bf16 | mxfp4; "
    "synthetic: a comma list of bf16, int4 (gpt-fast's), mxfp4 (default bf16)",
)
@click.option(
    "--kv",
    default=None,
    help="KV page format; sessions: default auto (as `run`: the model dtype, fp16 for a float32 model on the CPU "
    "kernels); synthetic: a comma list (default bf16)",
)
@click.option("--synthetic", "shape", default=None, help="a random-weight model of this shape, e.g. llama-3.1-8b")
@click.option("--batch", default="1", show_default=True, help="synthetic: comma-separated batch sizes")
@click.option(
    "--acceptance",
    default="0.8",
    show_default=True,
    help="synthetic: the benchmark drafter's acceptance rate, or a comma list of per-position rates (draft j "
    "accepted at rate j once those before it were; benchmarks/tree_estimate.py measures the heads')",
)
@click.option("--context", type=int, default=512, show_default=True, help="synthetic: tokens per request")
@click.option("--steps", type=int, default=64, show_default=True, help="synthetic: timed steps")
@click.option("--eager", is_flag=True, help="plain PyTorch modules, no CUDA graphs (the reference path)")
@cpu_act_option
@click.option(
    "--tp", type=int, default=1, show_default=True, help="sessions: split the model over N GPUs (docs/gpu.md)"
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="sessions: run the whole grid this many times and report each configuration's run of median throughput "
    "over all rounds but the first (default: 2 on CUDA, 1 on the CPU)",
)
@click.option(
    "--step-ahead",
    default="on",
    show_default=True,
    help="sessions: launch plain decode steps before reading the last one's tokens (CUDA graphs): on, off, or on,off",
)
@click.option(
    "--temperature", type=float, default=0.0, show_default=True, help="sessions: 0 = greedy, else sampled (unseeded)"
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=None,
    help="sessions: requests per run, the prompts cycled (default: the largest --sessions count); more than the "
    "sessions refill each finished one's slot",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per measurement")
def bench(model, device, dtype, sessions, prompts_file, max_tokens, drafter, k, weights, kv, shape, batch,
          acceptance, context, steps, eager, cpu_act, tp, rounds, step_ahead, temperature, requests,
          as_json) -> None:  # fmt: skip
    """Throughput and latency: --sessions N --prompts FILE [MODEL], or --synthetic SHAPE."""
    if (sessions is None) == (shape is None):
        raise click.UsageError("give either --sessions (with --prompts) or --synthetic")
    if shape is not None and model is not None:
        raise click.UsageError(f"--synthetic {shape} builds its own model; leave out MODEL ({model})")
    if shape is not None and requests is not None:
        raise click.UsageError("--requests works with --sessions; --synthetic times --steps steps of --batch requests")
    if shape is not None and tp != 1:
        raise click.UsageError("--tp works with --sessions; --synthetic builds one unsharded model")
    if shape is not None and cpu_act == "int8":
        raise click.UsageError(
            "--cpu-act works with --sessions; --synthetic builds random float weights, not GGUF blocks"
        )
    other_mode = given_flags(click.get_current_context(), SESSIONS_ONLY if shape is not None else SYNTHETIC_ONLY)
    if other_mode:  # refused, not ignored: a table that looks like the answer to another question
        mode, other = ("--synthetic", "--sessions") if shape is not None else ("--sessions", "--synthetic")
        raise click.UsageError(f"{', '.join(other_mode)}: for {other}, not {mode}")
    given_rate = shape is not None and k is not None and given_flags(click.get_current_context(), ("acceptance",))
    if given_rate and not any(int_list(k, "--k")):  # refused, not ignored: no row of the table would use it
        raise click.UsageError("--acceptance is for speculative rows (--k above 0); --k 0 decodes plainly")
    if shape is not None:
        weights, kv = weights or "bf16", kv or "bf16"
        bench_synthetic(shape, device, batch, weights, kv, k or "0,4", acceptance, context, steps, eager, as_json)
        return
    if prompts_file is None:
        raise click.UsageError("--sessions needs --prompts FILE")
    for flag, value, choices in (("--weights", weights, WEIGHT_CHOICES), ("--kv", kv, KV_CHOICES)):
        if value is not None and value not in choices:  # (EngineConfig's own error names no flag)
            raise ConfigError(f"{flag} takes {', '.join(choices)} with --sessions, got {value!r}")
    # What `specchat run` loads unless told otherwise: on the CPU, bf16 here would mean dense float weights and
    # pages the C attention does not read, which measured half the speed users get.
    config = EngineConfig(
        model=model or default_model(), device=device, dtype=dtype, weights=weights or "auto", kv_format=kv or "auto",
        eager=eager, tp=tp, cpu_act=cpu_act,
    )  # fmt: skip
    bench_sessions(
        config, prompts_file, sessions, max_tokens, drafter, k or "4", as_json, rounds, step_ahead, temperature,
        requests,
    )  # fmt: skip


def register(group: click.Group) -> None:
    group.add_command(bench)
