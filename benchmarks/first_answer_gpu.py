"""A chat's first answers on the GPU, with the load's warm-up of the model's default drafter and without it.

    PYTHONPATH=. python benchmarks/first_answer_gpu.py

Loads the default model on CUDA four times, alternating: `old` warms up plain decoding only (as Engine.load did
before it warmed the default drafter), `new` is Engine.load as it is. Each load then answers two short prompts with
the default drafter and adaptive k (128 tokens), timed. The first load also compiles Triton kernels into the
cache the others reuse, so read the second pair.
"""

from __future__ import annotations

import time

import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import WARM_UP_K, Engine

PROMPTS = ("Write a haiku about autumn leaves.", "Describe a sunset at the beach.")


def main() -> None:
    sampling = SamplingParams(max_tokens=128)
    for mode in ("old", "new", "old", "new"):
        t0 = time.perf_counter()
        if mode == "new":
            engine = Engine.load(EngineConfig(device="cuda"))
        else:
            engine = Engine.load(EngineConfig(device="cuda", warm_up=False))
            engine.warm_up(max_k=WARM_UP_K)
        torch.cuda.synchronize()
        loaded = time.perf_counter() - t0
        times = []
        for prompt in PROMPTS:
            t = time.perf_counter()
            engine.submit(prompt, sampling, SpecParams("default", k=None)).result()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        print(f"{mode}: load + warm-up {loaded:.2f} s, first answer {times[0]:.1f} ms, second {times[1]:.1f} ms")
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
