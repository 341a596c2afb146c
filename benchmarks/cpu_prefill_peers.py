"""A prompt's prefill on the CPU: specchat against HF transformers and llama.cpp, the same token ids, one run.

    python benchmarks/cpu_prefill_peers.py [--lengths 256,512,1024] [--threads 1] [--rounds 2] [--skip-hf]
        [--skip-llama]

Every engine reads the default model's Q4_1 GGUF and prefills the same prompt of N token ids (a fixed pattern of
ordinary ids, no chat template) on --threads cores: specchat through the engine with its default settings, one
request of max_tokens 1 (the prefix cache cleared first, so the whole prompt runs), timed from submit to the
finished answer; HF transformers one forward with `logits_to_keep=1` (its own GGUF loader, float32); llama.cpp
`Llama.eval` after a reset (llama-cpp-python, when installed: see benchmarks/cpu_peers.py). Each figure is the
best of --rounds, the rounds interleaved across engines so a change in the machine's load hits all of them.
Prints a markdown table (ms, and tokens per second) with the date, machine and commit.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from datetime import UTC, datetime

import torch


def prompt_ids(n: int) -> list[int]:
    return [(i * 37) % 40000 + 100 for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)

    from specchat import Engine, SamplingParams
    from specchat.config import EngineConfig, SpecParams
    from specchat.registry import fetch, resolve

    path = fetch(resolve("smollm2-135m"))
    engine = Engine.load(EngineConfig(model="smollm2-135m", device="cpu"))

    def specchat_prefill(ids: list[int]) -> None:
        engine.pool.clear_prefix_cache()
        engine.submit(ids, SamplingParams(max_tokens=1, ignore_eos=True), SpecParams(drafter="none")).result()

    runners = {"specchat (default settings)": specchat_prefill}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
        hf.eval()

        def hf_prefill(ids: list[int]) -> None:
            with torch.inference_mode():
                hf(torch.tensor([ids]), logits_to_keep=1)

        runners["HF transformers float32 (its GGUF loader)"] = hf_prefill
    if not args.skip_llama:
        try:
            from llama_cpp import Llama
        except ImportError:
            print("llama-cpp-python is not installed: no llama.cpp row (see benchmarks/cpu_peers.py)")
        else:
            llm = Llama(str(path), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=max(lengths) + 16,
                        n_batch=512, verbose=False)  # fmt: skip

            def llama_prefill(ids: list[int]) -> None:
                llm.reset()
                llm.eval(ids)

            runners["llama.cpp (llama-cpp-python, Q4_1 as stored)"] = llama_prefill

    for run in runners.values():  # warm-up: kernels built, caches touched
        run(prompt_ids(32))
    best = {(name, n): float("inf") for name in runners for n in lengths}
    for _ in range(args.rounds):
        for n in lengths:
            for name, run in runners.items():
                start = time.perf_counter()
                run(prompt_ids(n))
                best[name, n] = min(best[name, n], time.perf_counter() - start)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu} ({platform.machine()}, {args.threads} threads), commit "
          f"{commit}; best of {args.rounds} rounds")  # fmt: skip
    print("\n| engine | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name in runners:
        cells = [f"{best[name, n] * 1e3:,.0f} ms ({n / best[name, n]:,.0f} tok/s)" for n in lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
