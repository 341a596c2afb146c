"""A decode (and k = 4 verification) step of the default model on the CPU, per KV page format and context length.

    OMP_NUM_THREADS=2 python benchmarks/cpu_kv_formats.py [--formats fp32,fp16,bf16] [--contexts 235,1391,2751]

One request: a prompt of about the given length (a sentence repeated) is prefilled into a pool of each format,
then the same step (1 row, and 5 rows as a k = 4 verification) is timed over and over through
`ModelRunner.forward` with the pool truncated back after each: median over 5 blocks of --steps steps. The rows
"prefill" time the prompt itself (best of --prefills). The
default engine's weights (GGUF blocks, int8 rows where the CPU has VNNI or AVX2); the formats alternate at
each context, so a busy machine slows them alike. Ratios are against the first format at the same context.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import torch

from specchat.config import EngineConfig
from specchat.engine.engine import Engine
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import ModelRunner, StepBatch

SENTENCE = "Write a Python function that reverses a string, and explain it in detail please. "


def step_ms(runner: ModelRunner, pool: KVPool, n: int, rows: int, steps: int) -> float:
    feed = [7] * rows
    for _ in range(3):
        runner.forward(StepBatch([0], [feed], [n], [rows]))
        pool.truncate(0, n)
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.forward(StepBatch([0], [feed], [n], [rows]))
            pool.truncate(0, n)
        blocks.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp32,fp16,bf16")
    ap.add_argument("--contexts", default="235,1391,2751", help="approximate prompt tokens")
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefills", type=int, default=2, help="prefills of the prompt per format (the best is shown)")
    args = ap.parse_args()
    engine = Engine.load(EngineConfig(device="cpu"))
    model, c = engine.model, engine.model.cfg
    per_sentence = len(engine.tokenizer.encode(SENTENCE))
    formats, rows_list = args.formats.split(","), [int(r) for r in args.rows.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {torch.get_num_threads()} "
          f"threads, commit {commit}")  # fmt: skip
    print("| context | rows | " + " | ".join(f"{f} ms" for f in formats) + " | " + " | ".join(
        f"{f} vs {formats[0]}" for f in formats[1:]) + " |")  # fmt: skip
    print("|---:|---:|" + "---:|" * (2 * len(formats) - 1))
    for target in (int(x) for x in args.contexts.split(",")):
        prompt = engine.encode_prompt(SENTENCE * max(1, round(target / per_sentence)))
        n = len(prompt)
        pages = -(-(n + 8) // 16) + 2
        times: dict[tuple[str, int], float] = {}
        for fmt in formats:
            pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, pages, 16, torch.float32, "cpu", kv_format=fmt,
                          cpu_kernels=engine.pool.cpu_kernels)  # fmt: skip
            runner = ModelRunner(model, pool)
            pool.add(0, prompt + [5] * 8)
            prefills = []
            for _ in range(args.prefills):
                pool.truncate(0, 0)
                t0 = time.perf_counter()
                runner.forward(StepBatch([0], [prompt], [0], [n]))
                prefills.append((time.perf_counter() - t0) * 1e3)
            times[(fmt, "prefill")] = min(prefills)
            for rows in rows_list:
                times[(fmt, rows)] = step_ms(runner, pool, n, rows, args.steps)
        for rows in [*rows_list, "prefill"]:
            base = times[(formats[0], rows)]
            cells = " | ".join(f"{times[(f, rows)]:.2f}" for f in formats)
            ratios = " | ".join(f"{base / times[(f, rows)]:.2f}x" for f in formats[1:])
            print(f"| {n} | {rows} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
