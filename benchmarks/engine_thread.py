"""Decode speed with the engine stepped by the caller's thread (generate, bench) and by its own background thread
(`Engine.start()`: the TUI, serve, agent), alternating in one process.

    python benchmarks/engine_thread.py [--model smollm2-135m] [--device cpu] [--tokens 400] [--rounds 3]
                                       [--loader pool|main]

The model loads on a thread of a ThreadPoolExecutor that lives on (as the TUI's Textual workers do), or with
`--loader main` on the main thread (as serve and agent do), and one short request warms up on the main thread.
Before 2026-12-05 the OpenMP workers of those threads outlived their work and slowed every step of the thread
that steps (kernels/cpu_build.release_openmp_threads). Each round runs one greedy request of --tokens tokens
inline (stepped by the main thread), then one in the background (the engine is closed in between); prints
tok/s per round and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine

PROMPT = [{"role": "user", "content": "Write a long story about a robot who learns to paint."}]


def decode_rate(engine: Engine, tokens: int, drafter: str) -> float:
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
    started = time.perf_counter()
    finished = engine.submit(PROMPT, sampling, SpecParams(drafter=drafter, k=None if drafter != "none" else 0)).result()
    return len(finished.token_ids) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--loader", choices=("pool", "main"), default="pool")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device=args.device)
    loader = ThreadPoolExecutor(1)  # kept open until the end, as an app's worker pool is
    engine = loader.submit(Engine.load, config).result() if args.loader == "pool" else Engine.load(config)
    decode_rate(engine, 32, args.drafter)  # warm-up, on the loading thread (as Engine.load's callers do)
    rates: dict[str, list[float]] = {"inline": [], "background": []}
    for round_ in range(1, args.rounds + 1):
        rates["inline"].append(decode_rate(engine, args.tokens, args.drafter))
        engine.start()
        rates["background"].append(decode_rate(engine, args.tokens, args.drafter))
        engine.close()
        print(f"round {round_}: inline {rates['inline'][-1]:.1f} tok/s, background {rates['background'][-1]:.1f}")
    inline, background = (statistics.median(rates[k]) for k in ("inline", "background"))
    print(f"| stepped by | tok/s (median of {args.rounds}) | vs inline |\n|---|---:|---:|")
    print(f"| the caller's thread | {inline:.1f} | 1.00x |\n| the engine's thread | {background:.1f} | "
          f"{background / inline:.2f}x |")  # fmt: skip
    loader.shutdown()


if __name__ == "__main__":
    main()
