"""The n-gram drafter's shortest match: min_n 1 against 2, k = 4, decode tok/s against plain decoding, one engine.

    OMP_NUM_THREADS=1 python benchmarks/ngram_min_n.py [--repeats 2] [--per-category 2]

Prompts: the first --per-category of each category of the shipped eval split, and three free-form prompts (those
of benchmarks/cpu_peers.py: a story, an explanation, a function), each run under every configuration back to back
in a rotating order (benchmarks/spec_decode.py's speed pass); tok/s is the median over --repeats. The drafter
shipped as `ngram` uses DEFAULT_MIN_N (engine/drafters/ngram.py); this registers both floors beside it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import spec_decode
import torch
from cpu_peers import PROMPTS as FREE  # a story, an explanation, a function

from specchat.config import EngineConfig
from specchat.engine.drafters.ngram import NgramDrafter
from specchat.engine.engine import Engine
from specchat.engine.train_heads import CATEGORIES, load_prompt_set
from specchat.kernels import cpu_gemv_i8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    engine = Engine.load(EngineConfig(model="smollm2-135m", device="cpu"))
    for n in (1, 2):
        engine.drafters[f"ngram/{n}"] = NgramDrafter(min_n=n)
    free = [
        {"id": f"free{i}", "category": "free", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(FREE)
    ]
    prompts = [p for c in CATEGORIES for p in load_prompt_set("eval", (c,))[: args.per_category]] + free
    act = "int8" if cpu_gemv_i8.available() else "fp32"  # what --cpu-act auto picks
    configs = [(act, c) for c in ("none", "ngram/1:4", "ngram/2:4")]
    speed = spec_decode.speed_pass(engine, prompts, configs, args.max_tokens, args.repeats)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\ncommit {commit}, {torch.get_num_threads()} threads, {act} rows, k = 4, {args.max_tokens} new tokens")
    print("| prompts | plain tok/s | min_n 1 | min_n 2 |\n|---|---:|---:|---:|")
    for category in [*CATEGORIES, "free", "all"]:
        base = speed[(category, act, "none")]
        cells = " | ".join(
            f"{speed[(category, act, c)]:.1f} ({speed[(category, act, c)] / base:.2f}x)" for _, c in configs[1:]
        )
        print(f"| {category} | {base:.1f} | {cells} |")


if __name__ == "__main__":
    main()
