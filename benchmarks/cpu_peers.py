"""A GGUF on the CPU: specchat against HF transformers and llama.cpp, same prompts, one run.

    python benchmarks/cpu_peers.py [--runs 3] [--new-tokens 128] [--threads N] [--skip-hf] [--skip-llama]
        [--only plain,auto]   # specchat rows whose names contain one of these
        [--model FILE.gguf]   # default: the default model's Q4_1 GGUF

Every engine decodes the same file (the default model's Q4_1 GGUF, or --model's), greedy, --new-tokens tokens per
prompt with EOS ignored, on the same cores (--threads, default: what specchat picks, engine/loading.cpu_threads). Decode rate
= (new tokens - 1) / (generation time - time to the first token), so each prompt's prefill is left out; the
figure per engine is the median over prompts x runs, the runs interleaved across engines so a change in the
machine's load hits all of them. Rows: specchat per dtype, weights (the GGUF blocks read by the CPU kernels, or
dequantized float32 with --eager) and drafter; HF transformers (its own GGUF loader); llama.cpp
through llama-cpp-python, when it is installed. It is never a dependency of specchat; to include it:

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # builds llama.cpp from source (~10-20 min)

For a file with quantized types other than Q4_1 / Q8_0 (a Q4_K_M file, say) a row "as before 2026-12-06" loads it
with only those two types read as blocks, the rest as float32 weights, as specchat did until then
(engine/cpu_weights.QUANTIZED).

Also measured: load to first token (engine load + the first prompt's first token) with the model cached.
Prints a markdown table with the command, date, machine, load average and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import time
from datetime import UTC, datetime

import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when to use one.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
]


def specchat_rates(config, drafter: str, prompts: list[list[int]], new_tokens: int, engine=None, k: int | None = 4):
    from specchat import Engine, SamplingParams
    from specchat.config import SpecParams

    if engine is None:
        engine = Engine.load(config)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    spec = SpecParams(drafter=drafter, k=k)
    return engine, [engine.submit(ids, params, spec).result().tok_per_s for ids in prompts]


def hf_rates(model, prompts: list[list[int]], new_tokens: int) -> list[float]:
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    rates = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, **kwargs)
            t1 = time.perf_counter()
            model.generate(x, max_new_tokens=new_tokens, **kwargs)
            t2 = time.perf_counter()
            rates.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return rates


def llama_rates(llm, prompts: list[list[int]], new_tokens: int) -> list[float]:
    rates = []
    for ids in prompts:
        llm.reset()
        first = 0.0
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), 1):  # greedy, past EOS
            if count == 1:
                first = time.perf_counter()
            if count == new_tokens:
                break
        rates.append((new_tokens - 1) / (time.perf_counter() - first))
    return rates


LLAMA = "llama.cpp (llama-cpp-python, the file as stored)"


def gguf_types(path) -> set[str]:
    """The GGUF types of the file's 2-D tensors."""
    from specchat.engine.loader import gguf_reader

    return {t.tensor_type.name for t in gguf_reader(path).tensors if len(t.shape) == 2}


@contextlib.contextmanager
def stored_types_only():
    """Within it, only Q4_1 / Q8_0 tensors are read as blocks (the rest stay float32 weights), as before
    2026-12-06; the blocks cache is neither read nor written."""
    from specchat.engine import cpu_weights

    kept = cpu_weights.QUANTIZED, cpu_weights._load, cpu_weights._save
    cpu_weights.QUANTIZED = frozenset({"Q4_1", "Q8_0"})
    cpu_weights._load, cpu_weights._save = (lambda cache: None), (lambda cache, blocks: None)
    try:
        yield
    finally:
        cpu_weights.QUANTIZED, cpu_weights._load, cpu_weights._save = kept


def load_to_first_token(config, prompt: str) -> float:
    from specchat import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine.load(config)
    handle = engine.submit(engine.encode_prompt(prompt), SamplingParams(max_tokens=1))
    handle.result()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="default: specchat's choice (cpu_threads)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--only", default="", help="specchat rows whose names contain one of these, comma-separated")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--model", default="smollm2-135m", help="a registry alias or a GGUF file")
    args = ap.parse_args()

    from specchat import EngineConfig
    from specchat.engine.loading import cpu_threads
    from specchat.registry import fetch, resolve

    threads = args.threads or cpu_threads()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # specchat's loader keeps this count
    torch.set_num_threads(threads)
    path = fetch(resolve(args.model))
    model = str(path)
    load_s = load_to_first_token(EngineConfig(model=model, device="cpu"), PROMPTS[0])

    variants = {  # name -> (EngineConfig kwargs, drafter, k; None = auto)
        "specchat default (float32, GGUF blocks, --cpu-act auto), plain": ({}, "none", 4),
        "specchat default, default drafter, --k auto (what run / generate / serve do)": ({}, "default", None),
        "specchat default, ngram drafter, k = 4": ({}, "ngram", 4),
        "specchat default, default drafter (models.toml cpu_drafter: ngram+heads), k = 4": ({}, "default", 4),
        "specchat --cpu-act fp32 (GGUF blocks, float rows), plain": ({"cpu_act": "fp32"}, "none", 4),
        "specchat --cpu-act fp32, ngram drafter, k = 4": ({"cpu_act": "fp32"}, "ngram", 4),
        "specchat float32 --eager (dequantized), plain": ({"dtype": "float32", "eager": True}, "none", 4),
        "specchat float32 --eager, ngram drafter, k = 4": ({"dtype": "float32", "eager": True}, "ngram", 4),
        "specchat bfloat16 --eager, plain": ({"dtype": "bfloat16", "eager": True}, "none", 4),
    }
    types = gguf_types(path)
    if types - {"Q4_1", "Q8_0", "F32", "F16", "BF16"}:
        before = f"specchat default, {'+'.join(sorted(types))} as before 2026-12-06 (only Q4_1 / Q8_0 as blocks), plain"
        variants[before] = ({"before": True}, "none", 4)
    if args.only:
        variants = {name: v for name, v in variants.items() if any(part in name for part in args.only.split(","))}
        if not variants:  # (the peers' rows take the prompts' token ids from a specchat engine)
            ap.error(f"--only {args.only}: no specchat row matches")
    engines: dict[tuple, object] = {}
    runners = {}
    for name, (kwargs, drafter, k) in variants.items():
        key = tuple(sorted(kwargs.items()))
        kwargs = {key: value for key, value in kwargs.items() if key != "before"}
        config = EngineConfig(model=model, device="cpu", **kwargs)
        if key not in engines:
            with stored_types_only() if ("before", True) in key else contextlib.nullcontext():
                engines[key], _ = specchat_rates(config, drafter, [], args.new_tokens)
        engine = engines[key]
        ids = [engine.encode_prompt(p) for p in PROMPTS]
        runners[name] = lambda c=config, d=drafter, e=engine, p=ids, k=k: specchat_rates(
            c, d, p, args.new_tokens, e, k
        )[1]
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        for dtype in (torch.float32, torch.bfloat16):
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=dtype)
            hf.eval()
            runners[f"HF transformers {str(dtype)[6:]} (its GGUF loader)"] = lambda m=hf, p=ids: hf_rates(
                m, p, args.new_tokens
            )
    try:
        if args.skip_llama:
            raise ImportError
        from llama_cpp import Llama

        llm = Llama(str(path), n_threads=threads, n_ctx=1024, verbose=False)
        runners[LLAMA] = lambda p=ids: llama_rates(llm, p, args.new_tokens)
    except ImportError:
        if not args.skip_llama:
            print("llama-cpp-python is not installed: no llama.cpp row (see this script's docstring)")

    for run in runners.values():  # warm-up
        run()
    results: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.runs):
        for name, run in runners.items():
            results[name].extend(run())

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    print(
        f"`python benchmarks/cpu_peers.py --runs {args.runs} --model {args.model}` — "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu} "
    )
    print(f"file {path.name}: {'+'.join(sorted(types))}")
    print(f"({platform.machine()}, {os.cpu_count()} cores, {threads} threads), load average {os.getloadavg()[0]:.1f}")
    print(f"at the end, torch {torch.__version__}, commit {commit}; {args.new_tokens} new tokens x {len(PROMPTS)} ")
    print(f"prompts x {args.runs} runs; load to first token (default settings, cached): {load_s:.2f} s")
    print()
    base = statistics.median(results.get("HF transformers float32 (its GGUF loader)", [float("nan")]))
    llama = statistics.median(results.get(LLAMA, [float("nan")]))
    print("| engine | decode tok/s (median) | min | max | vs HF fp32 | vs llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rates in results.items():
        med = statistics.median(rates)
        print(f"| {name} | {med:.1f} | {min(rates):.1f} | {max(rates):.1f} | {med / base:.2f}x | {med / llama:.2f}x |")


if __name__ == "__main__":
    main()
