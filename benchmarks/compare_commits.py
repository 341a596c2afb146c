"""Decode speed and tokens per step of two commits, side by side in one run (a refactor must not slow us down).

    python benchmarks/compare_commits.py BASE [--head WORKTREE] [--runs 5] [--drafters none ngram default]
    python benchmarks/compare_commits.py BASE --host [--sessions 1,8,32]

--host measures the engine's own host work instead: a tiny random model (1 layer, 64 wide, 2,048-token
vocabulary, built here) whose forward costs little, plain greedy decoding of 64 requests at each session count
(run_sessions, as `specchat bench`), and reports tok/s and the host microseconds per request and step (wall
time less the runner's forward time, over the tokens generated): what bounds many sessions on a GPU.

BASE is checked out into a temporary git worktree; HEAD is this checkout (or --head). Each measurement runs in
its own process with that tree first on sys.path: load the default model (CPU, --dtype), one warm-up request,
then every prompt of benchmarks/session_prompts.txt (first --prompts) one at a time, greedy, --new-tokens each,
ignoring EOS. Decode tok/s = completion tokens after the first / time after the first token, summed over the
prompts; tokens per step from the engine's stats. Runs alternate between the trees; the table shows medians
and the spread (min-max) so that "within noise" can be read off it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MEASURE = r"""
import json, sys, time
import torch
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import specchat
assert specchat.__file__.startswith(args["tree"]), (specchat.__file__, args["tree"])
engine = Engine.load(EngineConfig(device="cpu", dtype=args["dtype"]))
sampling = SamplingParams(max_tokens=args["new_tokens"], ignore_eos=True)
engine.submit(args["prompts"][0], SamplingParams(max_tokens=8)).result()  # warm-up
out = {}
for drafter in args["drafters"]:
    tokens, seconds, emitted, steps = 0, 0.0, 0, 0
    for prompt in args["prompts"]:
        fin = engine.submit(prompt, sampling, spec=SpecParams(drafter=drafter, k=args["k"])).result()
        tokens += len(fin.token_ids) - 1
        seconds += fin.decode_s
        emitted += fin.stats.emitted
        steps += fin.stats.steps
    out[drafter] = {"tok_per_s": tokens / seconds, "tokens_per_step": emitted / steps}
print(json.dumps(out))
"""

MEASURE_HOST = r"""
import json, sys, time
import torch
from specchat.bench.sessions import run_sessions
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
import specchat
assert specchat.__file__.startswith(args["tree"]), (specchat.__file__, args["tree"])
engine = Engine.load(EngineConfig(model=args["model"], device="cpu", dtype=args["dtype"]))
forward_s = [0.0]
original = engine.runner.forward
def timed(*a, **kw):
    t0 = time.perf_counter()
    result = original(*a, **kw)
    forward_s[0] += time.perf_counter() - t0
    return result
engine.runner.forward = timed
plain = SpecParams(drafter="none", k=0)
run_sessions(engine, args["prompts"], 8, SamplingParams(max_tokens=16), plain)  # warm-up
out = {}
for n in args["sessions"]:
    forward_s[0] = 0.0
    sampling = SamplingParams(max_tokens=args["new_tokens"], ignore_eos=True)
    r = run_sessions(engine, args["prompts"], n, sampling, plain, requests=args["requests"])
    host_us = (r.wall_s - forward_s[0]) / r.completion_tokens * 1e6
    out[str(n)] = {"tok_per_s": r.tok_per_s, "host_us": host_us}
print(json.dumps(out))
"""


def measure(tree: Path, settings: dict, script: str = MEASURE) -> dict:
    result = subprocess.run(  # run in the tree: `python -c` puts the working directory first on sys.path
        [sys.executable, "-c", script, json.dumps({**settings, "tree": str(tree)})],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"measurement in {tree} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="a commit, e.g. 7d0c0e1")
    ap.add_argument("--head", type=Path, default=REPO, help="the tree to compare (default: this checkout)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--drafters", nargs="+", default=["none", "ngram", "heads"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--host", action="store_true", help="the engine's host work on a tiny model (see above)")
    ap.add_argument("--sessions", default="1,8,32", help="--host: session counts")
    ap.add_argument("--requests", type=int, default=64, help="--host: requests per session count")
    args = ap.parse_args()
    lines = (REPO / "benchmarks" / "session_prompts.txt").read_text().splitlines()
    if args.host:
        host(args, [line for line in lines if line.strip()])
        return
    prompts = [line for line in lines if line.strip()][: args.prompts]
    settings = {
        "prompts": prompts,
        "new_tokens": args.new_tokens,
        "drafters": args.drafters,
        "k": args.k,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    trees, runs = alternate(args, settings)
    print("| drafter | tree | decode tok/s median (min-max) | tokens/step | vs base |")
    print("|---|---|---:|---:|---:|")
    base_name = next(iter(trees))
    for drafter in args.drafters:
        base_rate = statistics.median(r[drafter]["tok_per_s"] for r in runs[base_name])
        for name in trees:
            rates = [r[drafter]["tok_per_s"] for r in runs[name]]
            per_step = statistics.median(r[drafter]["tokens_per_step"] for r in runs[name])
            median = statistics.median(rates)
            print(
                f"| {drafter} | {name} | {median:.1f} ({min(rates):.1f}-{max(rates):.1f}) | {per_step:.2f} "
                f"| {median / base_rate:.2f}x |"
            )


def alternate(args: argparse.Namespace, settings: dict, script: str = MEASURE) -> tuple[dict, dict]:
    """Run the measurement `args.runs` times in BASE's worktree and in the head tree, alternating."""
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(base_tree), args.base], check=True
        )
        try:
            trees = {f"base {args.base}": base_tree, "head": args.head}
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            for i in range(args.runs):
                for name, tree in trees.items():
                    runs[name].append(measure(tree, settings, script))
                    print(f"run {i + 1}/{args.runs} {name}: {runs[name][-1]}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=True)
    return trees, runs


def host(args: argparse.Namespace, prompts: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    from tests.conftest import save_tiny_hf  # the test suite's tiny random model, smaller still

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_hf(
            Path(tmp) / "tiny", {"vocab_size": 2048, "num_hidden_layers": 1, "max_position_embeddings": 512}
        )
        sessions = [int(n) for n in args.sessions.split(",")]
        settings = {
            "model": str(model),
            "prompts": prompts,
            "new_tokens": 64,
            "sessions": sessions,
            "requests": args.requests,
            "dtype": "float32",
            "threads": args.threads,
        }
        trees, runs = alternate(args, settings, MEASURE_HOST)
    print("| sessions | tree | tok/s median (min-max) | host us per request-step median (min-max) | vs base |")
    print("|---:|---|---:|---:|---:|")
    base_name = next(iter(trees))
    for n in map(str, sessions):
        base_rate = statistics.median(r[n]["tok_per_s"] for r in runs[base_name])
        for name in trees:
            rates = [r[n]["tok_per_s"] for r in runs[name]]
            host_us = [r[n]["host_us"] for r in runs[name]]
            median = statistics.median(rates)
            print(
                f"| {n} | {name} | {median:.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
                f"{statistics.median(host_us):.1f} ({min(host_us):.1f}-{max(host_us):.1f}) | {median / base_rate:.2f}x |"
            )


if __name__ == "__main__":
    main()
