"""A 1B-parameter Q4_K_M GGUF on the CPU: load time, memory and decode speed, before and after the K-quant blocks,
against llama.cpp on the same file; each case in a fresh process.

    python benchmarks/cpu_gguf_large.py [--tokens 64] [--runs 2] [--shape 2048,8192,16,32,8] [--keep FILE]

The file (written once to --keep, default /tmp/specchat-q4_k_m-1b.gguf): the shape of Llama-3.2-1B's body (hidden
2048, FFN 8192, 16 layers, 32 heads, 8 KV heads) with random Q4_K / Q6_K bytes as llama.cpp's Q4_K_M mix stores
them (tests/engine/tiny_gguf.py: Q6_K for attn_v, ffn_down and the output head), a 512-token vocabulary. Its
linears hold 0.97 B weights: 3.9 GB in float32, past the loader's float cache (GGUF_CACHE_MAX_BYTES).

Cases: "before" (only Q4_1 / Q8_0 read as blocks, the rest float32 weights: specchat until 2026-12-06), "blocks,
float32 first" (the K-quant blocks, every linear dequantized at load first: the loader's deferral off), "now" (the
blocks, the linears never dequantized), llama.cpp (llama-cpp-python, if installed). Per case: seconds to load,
resident memory after the load and the process's peak (getrusage), greedy decode tok/s over --tokens tokens (the
first token's time left out), median of --runs. The derived caches are kept in a scratch $SPECCHAT_HOME per case,
so every load parses the file afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

SPECCHAT = r"""
import json, resource, statistics, sys, time
from unittest import mock
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine import cpu_weights, loader
from specchat.engine.engine import Engine
from specchat.ui.bridge import rss_bytes

path, case, tokens, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
patches = []
if case == "before":
    patches.append(mock.patch.object(cpu_weights, "QUANTIZED", frozenset({"Q4_1", "Q8_0"})))
if case == "blocks, float32 first":
    patches.append(mock.patch.object(loader, "load_gguf", lambda path, progress=None, cache=None, defer=None: LOAD(
        path, progress, cache)))
LOAD = loader.load_gguf
for p in patches:
    p.start()
start = time.perf_counter()
engine = Engine.load(EngineConfig(model=path, device="cpu"))
seconds, loaded = time.perf_counter() - start, rss_bytes()
rates = []
for _ in range(runs + 1):  # the first one warms up
    result = engine.submit([1] + [5] * 15, SamplingParams(max_tokens=tokens, ignore_eos=True), SpecParams("none", k=0))
    rates.append(result.result().tok_per_s)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": seconds, "rss": loaded, "peak": peak, "tok_s": statistics.median(rates[1:])}))
"""

LLAMA = r"""
import json, resource, statistics, sys, time
from llama_cpp import Llama
from specchat.ui.bridge import rss_bytes

path, tokens, runs, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
llm = Llama(path, n_threads=threads, n_ctx=512, verbose=False)
seconds, loaded = time.perf_counter() - start, rss_bytes()
rates = []
for _ in range(runs + 1):
    llm.reset()
    for count, _ in enumerate(llm.generate([1] + [5] * 15, temp=0.0, top_k=1, reset=True), 1):
        if count == 1:
            first = time.perf_counter()
        if count == tokens:
            break
    rates.append((tokens - 1) / (time.perf_counter() - first))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"load_s": seconds, "rss": loaded, "peak": peak, "tok_s": statistics.median(rates[1:])}))
"""

CASES = ("before", "blocks, float32 first", "now")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--shape", default="2048,8192,16,32,8", help="hidden, ffn, layers, heads, kv heads")
    ap.add_argument("--keep", default="/tmp/specchat-q4_k_m-1b.gguf")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from specchat.engine.loading import cpu_threads
    from tests.engine.tiny_gguf import write_tiny_gguf

    path = Path(args.keep)
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write_tiny_gguf(path, kquants=True, shape=tuple(int(n) for n in args.shape.split(",")))
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rows = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as home:
            build = Path(os.environ.get("SPECCHAT_HOME", Path.home() / ".cache/specchat")) / "kernels"
            if build.is_dir():  # the kernels' build is not what is timed
                shutil.copytree(build, Path(home) / "kernels")
            argv = [sys.executable, "-c", SPECCHAT, str(path), case, str(args.tokens), str(args.runs)]
            out = subprocess.run(argv, env={**env, "SPECCHAT_HOME": home}, capture_output=True, text=True)
        rows[f"specchat, {case}"] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        if out.returncode:
            print(f"{case}: failed\n{out.stderr[-2000:]}")
    argv = [sys.executable, "-c", LLAMA, str(path), str(args.tokens), str(args.runs), str(cpu_threads())]
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode == 0:
        rows["llama.cpp (llama-cpp-python)"] = json.loads(out.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    print(f"`python benchmarks/cpu_gguf_large.py --tokens {args.tokens} --runs {args.runs} --shape {args.shape}` — "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {commit.stdout.strip()}, {cpu_threads()} threads, "
          f"file {path.stat().st_size / 1e9:.2f} GB")  # fmt: skip
    print()
    print("| case | load s | RSS after load GB | peak RSS GB | decode tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        if r is None:
            print(f"| {name} | failed | | | |")
            continue
        print(f"| {name} | {r['load_s']:.1f} | {r['rss'] / 1e9:.2f} | {r['peak'] / 1e9:.2f} | {r['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
