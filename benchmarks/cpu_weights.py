"""Decode speed of the default model on the CPU per weight format and drafter, side by side in one run.

    OMP_NUM_THREADS=2 python benchmarks/cpu_weights.py [--formats bf16,mxfp4] [--drafters none,ngram+heads:auto]
        [--cpu-act auto]

`bf16` is the checkpoint's own weights (on the CPU: the GGUF file's Q4_1 / Q8_0 blocks), `mxfp4` the engine's MXFP4
weights (`Engine.set_weights`, the cached GPTQ result: run `specchat quantize` once first, or the first switch
computes it), each with the activation rows of `--cpu-act` (auto: int8 where cpu_gemv_i8 loads; a comma list runs
each: `fp32,int8` sets them between prompts, engine/cpu_weights.set_activations).
One engine; eval prompts of the shipped prompt set, each run alone under every (format, rows, drafter), the
formats and rows switched between prompts in alternating order so that a busy machine slows them alike (the
switch is not timed). Decode tok/s per configuration (median over --repeats of the prompts' total), its ratio to
the first configuration's plain decoding, tokens per step, and whether each greedy text equals that
configuration's plain one. Resident weight bytes per configuration from the engine's memory report.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from collections import defaultdict

import torch
from spec_decode import spec_of

from specchat.config import EngineConfig, SamplingParams
from specchat.engine.cpu_weights import set_activations
from specchat.engine.engine import Engine
from specchat.engine.train_heads import CATEGORIES, load_prompt_set
from specchat.kernels import cpu_gemv_i8


def use_rows(engine: Engine, rows: str) -> None:
    """The GGUF-block and MXFP4 linears' activation rows ("fp32" or "int8")."""
    set_activations(engine.model, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,mxfp4")
    ap.add_argument("--drafters", default="none,ngram+heads:auto", help="none, DRAFTER:K or DRAFTER:auto each")
    ap.add_argument("--per-category", type=int, default=2, help="eval prompts per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cpu-act", default="auto", help="comma list of auto, fp32, int8: each is run")
    args = ap.parse_args()
    formats, drafters = args.formats.split(","), args.drafters.split(",")
    acts = [("int8" if cpu_gemv_i8.available() else "fp32") if a == "auto" else a for a in args.cpu_act.split(",")]
    configs = [(fmt, act) for fmt in formats for act in acts]
    engine = Engine.load(EngineConfig(device="cpu", cpu_act=acts[-1]))
    for fmt in formats:  # (a first switch to MXFP4 may compute its GPTQ result: not in the timed part)
        engine.set_weights(fmt)
    memory = {}
    prompts = [p for c in CATEGORIES for p in load_prompt_set("eval", (c,))[: args.per_category]]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {torch.get_num_threads()} "
          f"threads, commit {commit}, {len(prompts)} eval prompts, {args.max_tokens} tokens, greedy")  # fmt: skip
    totals: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    steps, tokens, same = defaultdict(int), defaultdict(int), defaultdict(int)
    for rep in range(args.repeats):
        seconds: dict[tuple[str, str, str], float] = defaultdict(float)
        emitted: dict[tuple[str, str, str], int] = defaultdict(int)
        for i, prompt in enumerate(prompts):
            order = configs if (i + rep) % 2 == 0 else configs[::-1]
            for fmt, act in order:
                engine.set_weights(fmt)
                use_rows(engine, act)
                memory.setdefault((fmt, act), engine.memory()["weights_bytes"])
                plain = None
                for name in drafters:
                    fin = engine.submit(prompt["messages"], params, spec_of(name)).result()
                    key = (fmt, act, name)
                    seconds[key] += fin.decode_s
                    emitted[key] += len(fin.token_ids) - 1  # the first token is the prompt's
                    if rep == 0:
                        steps[key] += fin.stats.steps
                        tokens[key] += fin.stats.emitted
                        plain = fin.token_ids if plain is None else plain
                        same[key] += fin.token_ids == plain
            print(f"repeat {rep + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)}", flush=True)
        for key, s in seconds.items():
            totals[key].append(emitted[key] / s)
    base = statistics.median(totals[(*configs[0], drafters[0])])
    print("| weights | rows | resident MB | drafter | tokens/step | same as its plain | tok/s | vs first plain |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for fmt, act in configs:
        mb = memory[(fmt, act)]
        for name in drafters:
            key = (fmt, act, name)
            tps = statistics.median(totals[key])
            print(f"| {fmt} | {act} | {mb / 2**20:.0f} | {name} | {tokens[key] / steps[key]:.2f} | "
                  f"{same[key]}/{len(prompts)} | {tps:.1f} | {tps / base:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
