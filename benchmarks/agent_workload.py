"""Agent workload: N concurrent runs of an agent script on one engine, once per drafter, side by side.

    PYTHONPATH=. python benchmarks/agent_workload.py --script examples/agents/arithmetic.toml --concurrency 4

For each drafter (none, ngram, heads, draft-model; the engine's missing ones are reported, not run) every round
runs the script's tasks with greedy sampling. Greedy verification is lossless, so every drafter must produce the
same transcripts as plain decoding (the last column checks it); the work is then the same and wall times compare
directly: the speedup is none's median wall time over the drafter's, and tokens/s counts the tokens the
transcripts keep (a step that verifies several tokens can run past a stop string; the tokens past it are
generated but dropped, so generated counts differ between drafters). Per drafter it also prints tokens per step
and acceptance (engine SpecStats over every turn of every run), target steps (forwards, summed over requests)
and the prefix-cache hit rate (prompt tokens taken from the cache / prompt tokens of every turn). The prefix
cache is emptied before each session, so every drafter starts cold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specchat.agent.runner import AgentSession, RunOutcome
from specchat.agent.script import AgentScript, load_script
from specchat.agent.trace import SessionEnd
from specchat.config import DRAFTERS, EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.errors import SpecchatError


def run_session(engine: Engine, script: AgentScript, concurrency: int) -> tuple[SessionEnd, list[RunOutcome]]:
    """One session from a cold prefix cache, with the step loop in the background."""
    engine.pool.clear_prefix_cache()
    summary: list[SessionEnd] = []
    engine.start()
    try:
        session = AgentSession(engine, script, concurrency)
        outcomes = session.run(lambda event: summary.append(event) if isinstance(event, SessionEnd) else None)
    finally:
        engine.close()
    return summary[0], outcomes


def available(engine: Engine, drafter: str) -> str | None:
    """None when the engine can draft with `drafter`, else why not (one line)."""
    try:
        engine.drafter(drafter)
    except SpecchatError as error:
        return str(error)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, default=Path("examples/agents/arithmetic.toml"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--unaided",
        action="store_true",
        help="drop the script's small-model aids (tool_choice auto, no worked examples): longer, repetitive turns",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw summaries here")
    args = parser.parse_args()

    script = load_script(args.script)
    script = dataclasses.replace(
        script, max_wall_s=3600.0, sampling=dataclasses.replace(script.sampling, temperature=0.0)
    )
    if args.unaided:
        script = dataclasses.replace(script, tool_choice="auto", examples=[])
    engine = Engine.load(EngineConfig(model=script.model, device=args.device, dtype=args.dtype))
    engine.submit("warm up", SamplingParams(max_tokens=4)).result()
    drafters = [name for name in args.drafters.split(",") if name]
    missing = {name: why for name in drafters if (why := available(engine, name)) is not None}
    runnable = [name for name in drafters if name not in missing]

    results: dict[str, list[SessionEnd]] = {name: [] for name in runnable}
    transcripts: dict[str, list] = {}
    for _ in range(args.rounds):
        for name in runnable:  # interleaved, so that load on the machine hits every drafter alike
            spec = SpecParams(drafter=name, k=args.k if name != "none" else 0, k_max=max(args.k, 8))
            summary, outcomes = run_session(engine, dataclasses.replace(script, speculation=spec), args.concurrency)
            results[name].append(summary)
            transcripts[name] = [outcome.messages for outcome in outcomes]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else platform.processor() or "cpu"
    aids = ", unaided" if args.unaided else ""
    print(f"# {args.script}{aids} x{len(script.tasks)} tasks, concurrency {args.concurrency}, k={args.k}, greedy, ")
    print(f"# {engine.device.type} ({device}), torch threads {torch.get_num_threads()}, {args.rounds} rounds, ")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}")
    print(
        "| drafter | wall s (median) | speedup | tokens/s | tokens/step | acceptance | target steps "
        "| prefix-cache hits | same transcripts as none |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    baseline = statistics.median(summary.elapsed_s for summary in results["none"]) if "none" in results else None
    kept_tokens = results["none"][-1].tokens if "none" in results else None  # what the transcripts hold
    for name, summaries in results.items():
        last = summaries[-1]
        wall = statistics.median(summary.elapsed_s for summary in summaries)
        speedup = f"{baseline / wall:.2f}x" if baseline else "n/a"
        hits = "n/a" if last.prefix_hit_rate is None else f"{last.prefix_hit_rate:.0%}"
        same = "yes" if transcripts[name] == transcripts.get("none", transcripts[name]) else "NO"
        tok_per_s = (kept_tokens or last.tokens) / wall
        print(
            f"| {name} | {wall:.1f} | {speedup} | {tok_per_s:.1f} | {last.stats['tokens_per_step']:.2f} "
            f"| {last.stats['acceptance_rate']:.0%} | {last.stats['steps']} | {hits} | {same} |"
        )
    for name, why in missing.items():
        print(f"| {name} | missing: {why} | | | | | | | |")
    if args.json is not None:
        raw = {name: [dataclasses.asdict(summary) for summary in summaries] for name, summaries in results.items()}
        args.json.write_text(json.dumps({"results": raw, "missing": missing}, indent=1))


if __name__ == "__main__":
    main()
