"""Plain greedy decode of the default model: specchat vs HF transformers `generate`, side by side in one run.

    python benchmarks/cpu_decode.py [--runs 3] [--new-tokens 128] [--dtypes float32 bfloat16] [--compile]

Decode rate = (new tokens - 1) / (time of the whole generation - time to the first token), so the prompt's
prefill is left out on both sides. Medians over --runs, runs interleaved. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from datetime import date

import torch

from specchat import Engine, EngineConfig, SamplingParams
from specchat.registry import fetch

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. "
    "Describe the sea, the weather and what the message says."
)


def hf_decode_rate(model, ids: list[int], new_tokens: int) -> float:
    x = torch.tensor([ids])
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        model.generate(x, max_new_tokens=new_tokens, **kwargs)
        t2 = time.perf_counter()
    return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))


def our_decode_rate(engine: Engine, ids: list[int], new_tokens: int) -> float:
    fin = engine.submit(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True)).result()
    return fin.tok_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--compile", action="store_true", help="also time our model under torch.compile")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        engine = Engine.load(EngineConfig(device="cpu", dtype=dtype_name))
        path = fetch(engine.model_spec)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=dtype).eval()
        ids = engine.encode_prompt(PROMPT)
        variants = {"specchat": engine}
        if args.compile:
            compiled = Engine.load(EngineConfig(device="cpu", dtype=dtype_name))
            compiled.model.forward = torch.compile(compiled.model.forward, dynamic=True)
            variants["specchat torch.compile"] = compiled
        results: dict[str, list[float]] = {name: [] for name in ["HF transformers", *variants]}
        for eng in variants.values():  # warm-up (and compilation)
            our_decode_rate(eng, ids, 16)
        hf_decode_rate(hf, ids, 16)
        for _ in range(args.runs):
            results["HF transformers"].append(hf_decode_rate(hf, ids, args.new_tokens))
            for name, eng in variants.items():
                results[name].append(our_decode_rate(eng, ids, args.new_tokens))
        base = statistics.median(results["HF transformers"])
        for name, rates in results.items():
            med = statistics.median(rates)
            rows.append((dtype_name, name, med, min(rates), max(rates), med / base))
        del hf, engine, variants

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"Plain greedy decode, default model, prompt {len(ids)} tokens, {args.new_tokens} new tokens, ")
    print(f"median of {args.runs} runs; {date.today()}, {platform.machine()} CPU x{torch.get_num_threads()} threads, ")
    print(f"torch {torch.__version__}, commit {commit}")
    print()
    print("| dtype | engine | tok/s (median) | min | max | vs HF |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype_name, name, med, lo, hi, ratio in rows:
        print(f"| {dtype_name} | {name} | {med:.1f} | {lo:.1f} | {hi:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
