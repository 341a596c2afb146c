"""Where the time of a prefill step goes on the GPU (a fresh prompt runs eagerly, outside the CUDA graphs).

    PYTHONPATH=. python benchmarks/profile_prefill.py [--device cuda] [--lengths 40,200] [--repeats 10]

The default model, warmed up; for each prompt length, `--repeats` one-token requests one after the other (prefix
cache cleared, so every one prefills its whole prompt): the median wall time from submit to the first token, and
the same for a decode-only step for scale. Then one prefill under torch.profiler: the ops with the most CPU time
(launch and Python overhead on the host) and CUDA time, and the number of kernels launched.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine


def prompt_of(n: int, salt: int) -> list[int]:
    """A token-id prompt of exactly n tokens, salted so that no two share a prefix."""
    return [100 + salt % 50] + [1000 + (i * 7 + salt) % 5000 for i in range(n - 1)]


def time_first_token(engine: Engine, n: int, salt: int) -> float:
    engine.pool.clear_prefix_cache()
    t0 = time.perf_counter()
    engine.submit(prompt_of(n, salt), SamplingParams(max_tokens=1), SpecParams(drafter="none", k=0)).result()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="40,200")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    engine = Engine.load(EngineConfig(model=args.model, device=args.device))
    lengths = [int(x) for x in args.lengths.split(",")]
    print("| prompt tokens | submit -> first token, median ms | min | max |")
    print("|---:|---:|---:|---:|")
    for n in lengths:
        time_first_token(engine, n, 999)  # first-time shapes
        ms = [time_first_token(engine, n, salt) for salt in range(args.repeats)]
        print(f"| {n} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} |")
    t0 = time.perf_counter()
    out = engine.submit(prompt_of(40, 5), SamplingParams(max_tokens=65, ignore_eos=True)).result()
    total = (time.perf_counter() - t0) * 1e3
    print(f"\n40-token prompt + 64 decode steps: {total:.1f} ms ({len(out.token_ids)} tokens)")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for n in lengths:
        engine.pool.clear_prefix_cache()
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            time_first_token(engine, n, 12345)
            sync()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"\n## prefill of {n} tokens under torch.profiler: {kernels} GPU kernels")
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
