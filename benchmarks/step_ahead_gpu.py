"""Plain decoding with and without steps ahead (SpecStep's step ahead), alternating on one loaded engine.

    PYTHONPATH=. python benchmarks/step_ahead_gpu.py [--sessions 1,8,32] [--reps 3] [--max-tokens 64]

Runs the shipped session prompts (32 requests, at most N in flight) with steps ahead on and off in turn, `reps`
times each, the order flipped every repetition so that drift of the machine falls on both; prints the median
tok/s, ITL P50, the share of steps that ran ahead, and per step the host's time and its wait for the device's
tokens (a wait near zero: the host is the bottleneck, and running ahead cannot help).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specchat.bench.sessions import run_sessions
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine

PROMPTS = Path(__file__).with_name("session_prompts.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    prompts = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    engine = Engine.load(EngineConfig(model=args.model, device=args.device))
    engine.warm_up(sessions=max(counts))
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    spec = SpecParams(drafter="none", k=0)
    step = engine.spec_step
    engine_steps = [0]
    engine_step = engine.step

    def counted_step():
        engine_steps[0] += 1
        return engine_step()

    engine.step = counted_step  # engine steps, for the per-step figures
    rows: dict[tuple[int, bool], list[tuple[float, float, float, float, float]]] = {}
    run_sessions(engine, prompts, max(counts), sampling, spec, requests=args.requests)  # a first pass: warm
    for rep in range(args.reps):
        for n in counts:
            for ahead in (True, False) if rep % 2 == 0 else (False, True):
                step.runs_ahead = ahead and engine.runner.overlaps
                steps0, continued0, waited0 = engine_steps[0], step.continued, step.waited_s
                t = time.perf_counter()
                r = run_sessions(engine, prompts, n, sampling, spec, requests=args.requests)
                wall = time.perf_counter() - t
                steps = engine_steps[0] - steps0
                waited = step.waited_s - waited0
                rows.setdefault((n, ahead), []).append(
                    (r.tok_per_s, r.itl_p50_ms or 0.0, (step.continued - continued0) / steps,
                     (wall - waited) * 1e3 / steps, waited * 1e3 / steps)
                )  # fmt: skip
    step.runs_ahead = engine.runner.overlaps
    print(f"{args.model} on {args.device}, {args.requests} requests x {args.max_tokens} tokens, medians of {args.reps}")
    print("| sessions | steps ahead | tok/s | vs off | ITL P50 ms | steps run ahead | host ms/step | wait ms/step |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        off = statistics.median(r[0] for r in rows[n, False])
        for ahead in (True, False):
            med = [statistics.median(r[i] for r in rows[n, ahead]) for i in range(5)]
            print(
                f"| {n} | {'on' if ahead else 'off'} | {med[0]:,.0f} | {med[0] / off:.3f}x | {med[1]:.3f} | "
                f"{med[2]:.0%} | {med[3]:.3f} | {med[4]:.3f} |"
            )


if __name__ == "__main__":
    main()
