"""Speculative decoding on the default model, per drafter and k, over the shipped prompt set's eval split.

Greedy. Two passes, because acceptance does not depend on timing but tok/s does:

1. acceptance: every eval prompt under every configuration, all submitted at once (the scheduler batches them,
   which is quick on a CPU). Per category: acceptance rate and tokens per step (SpecStats definitions), and
   whether each run's tokens equal plain greedy decoding's.
2. speed (batch 1, as Spec-Bench): a few prompts per category, each run alone once per timed configuration,
   the configurations of a prompt back to back in a rotating order so that a busy machine slows them alike.
   Decode tok/s per category and its ratio to plain decoding in the same run (median over --repeats).

`--cpu-act fp32,int8` runs both passes under each activation format of the CPU block kernels on one engine
(engine/cpu_weights.set_activations between runs; the speed pass interleaves them like the configurations), so
int8 and float activations are compared in one run; a prompt's plain decoding under each is also compared.

    python benchmarks/spec_decode.py --configs none,ngram:4,heads:4 --timed none,heads:4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

from specchat.config import CPU_ACTIVATIONS, EngineConfig, SamplingParams, SpecParams
from specchat.engine.adaptive import RateMemory, StepCosts
from specchat.engine.cpu_weights import set_activations
from specchat.engine.engine import Engine
from specchat.engine.stats import SpecStats
from specchat.engine.train_heads import CATEGORIES, load_prompt_set
from specchat.kernels import cpu_gemv_i8

DEFAULT_CONFIGS = "none,ngram:2,ngram:4,ngram:6,ngram:auto,heads:1,heads:2,heads:3,heads:4,heads:5,heads:auto"
DEFAULT_TIMED = "none,ngram:4,heads:4,heads:auto"


def spec_of(config: str) -> SpecParams:
    """'none' | 'DRAFTER:K' | 'DRAFTER:auto' -> SpecParams."""
    if config == "none":
        return SpecParams(drafter="none", k=0)
    drafter, _, k = config.rpartition(":")
    return SpecParams(drafter=drafter, k=None if k == "auto" else int(k))


def acceptance_pass(engine: Engine, prompts: list[dict], configs: list[str], acts: list[str], max_tokens: int):
    """(category, act, config) -> (merged SpecStats, prompts whose tokens equal plain greedy under the same
    activations, prompts); and per category, prompts whose plain tokens are the same under every activation."""
    sampling = SamplingParams(max_tokens=max_tokens)
    results = {}
    for act in acts:
        set_activations(engine.model, act)
        handles = {(p["id"], c): engine.submit(p["messages"], sampling, spec_of(c)) for p in prompts for c in configs}
        results |= {(pid, act, c): handle.result() for (pid, c), handle in handles.items()}
    cells: dict = defaultdict(lambda: [SpecStats(), 0, 0])
    same_plain: dict = defaultdict(int)
    for p in prompts:
        plains = [results[(p["id"], act, "none")].token_ids for act in acts]
        for category in (p["category"], "all"):
            same_plain[category] += all(tokens == plains[0] for tokens in plains)
        for act, plain in zip(acts, plains, strict=True):
            for c in configs:
                fin = results[(p["id"], act, c)]
                for category in (p["category"], "all"):
                    cell = cells[(category, act, c)]
                    cell[0].merge(fin.stats)
                    cell[1] += fin.token_ids == plain
                    cell[2] += 1
    return cells, same_plain


def speed_pass(engine: Engine, prompts: list[dict], configs: list[tuple[str, str]], max_tokens: int, repeats: int):
    """(category, act, config) -> median over repeats of decode tok/s (tokens after the first / their decode
    time); `configs` are (activations, configuration) pairs."""
    sampling = SamplingParams(max_tokens=max_tokens)
    runs: dict = defaultdict(list)
    # what adaptive K learnt in the acceptance pass (every prompt at once: batched steps' costs and rates) must not
    # set the lone requests' first k here; within this pass requests learn from each other, as a chat's turns do
    engine.scheduler.costs, engine.scheduler.memory, engine.scheduler.gates = StepCosts(), RateMemory(), {}
    for repeat in range(repeats):
        tokens: dict = defaultdict(int)
        seconds: dict = defaultdict(float)
        for n, p in enumerate(prompts):
            shift = (n + repeat) % len(configs)
            for act, c in configs[shift:] + configs[:shift]:
                set_activations(engine.model, act)
                fin = engine.submit(p["messages"], sampling, spec_of(c)).result()
                for category in (p["category"], "all"):
                    tokens[(category, act, c)] += max(0, len(fin.token_ids) - 1)
                    seconds[(category, act, c)] += fin.decode_s
            print(f"speed: repeat {repeat + 1}/{repeats}, prompt {n + 1}/{len(prompts)}", flush=True)
        for key, secs in seconds.items():
            runs[key].append(tokens[key] / secs if secs else 0.0)
    return {key: statistics.median(values) for key, values in runs.items()}


def add_heads(engine: Engine, suffix: str, path: Path | None = None, **options) -> None:
    """Register heads{SUFFIX} and ngram+heads{SUFFIX}: the heads in `path` (default: the model's shipped ones),
    drafting with HeadsDrafter.from_file's `options` (cpu_blocks, draft_rows, min_confidence)."""
    from specchat.engine.drafters.base import DATA_DIR
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.engine.drafters.hybrid import NgramThenHeads

    path = path or DATA_DIR / engine.model_spec.heads
    drafter = HeadsDrafter.from_file(path, engine.model, graphs=False, **options)
    engine.drafters[f"heads{suffix}"] = drafter
    engine.drafters[f"ngram+heads{suffix}"] = NgramThenHeads(drafter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="acceptance pass: none, DRAFTER:K, DRAFTER:auto")
    ap.add_argument("--timed", default=DEFAULT_TIMED, help="speed pass configurations ('' to skip the pass)")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--per-category", type=int, default=0, help="eval prompts per category (0 = all)")
    ap.add_argument("--timed-per-category", type=int, default=2, help="prompts per category in the speed pass")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="speed pass: tok/s is the median over repeats")
    ap.add_argument("--cpu-act", default="fp32", help=f"comma list of {', '.join(CPU_ACTIVATIONS)}: each is run")
    ap.add_argument(
        "--free-form",
        action="store_true",
        help="also time benchmarks/cpu_peers.py's three free-form prompts (a story, an explanation, a function) as "
        "the category 'free' (speed pass only: they have no answers to judge acceptance by)",
    )
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--heads-rows",
        default="",
        help="comma list of N: also the drafters heads@N and ngram+heads@N, drafting from the N most frequent entries "
        "of the shipped heads' draft vocabulary only (use them in --configs / --timed)",
    )
    ap.add_argument(
        "--hybrid-heads-k",
        default="",
        help="comma list of H: also the drafter ngram+heads/H, whose heads draft at most H tokens where the n-grams "
        "miss (the n-grams up to the step's k)",
    )
    ap.add_argument(
        "--heads-floor",
        default="",
        help="comma list of F: also the drafters heads~F and ngram+heads~F, whose greedy chains stop below chain "
        "probability F (0: never) instead of the packed heads' default",
    )
    ap.add_argument(
        "--heads-float",
        action="store_true",
        help="also the drafters heads%%float and ngram+heads%%float: the shipped heads as plain float modules (what "
        "--eager drafts with; on a float target the heads' drafting before they read Q8_0 blocks there too)",
    )
    ap.add_argument(
        "--eagle-mxfp4",
        action="store_true",
        help="also the drafter eagle%%mxfp4: the shipped EAGLE-3 head with MXFP4 linears (the form it takes beside "
        "MXFP4 target weights), beside `eagle`, which takes the target's form (float here: the CPU's target)",
    )
    ap.add_argument(
        "--heads-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also the drafters heads#NAME and ngram+heads#NAME: the heads in PATH (repeatable); with --heads-floor "
        "also heads#NAME~F and ngram+heads#NAME~F",
    )
    args = ap.parse_args()

    # auto: what the engine picks on this CPU (int8 rows where the int8 kernels run), named as it is run
    acts = [("int8" if cpu_gemv_i8.available() else "fp32") if a == "auto" else a for a in args.cpu_act.split(",")]
    engine = Engine.load(EngineConfig(model=args.model, device="cpu", dtype=args.dtype, cpu_act=acts[-1]))
    # heads@ROWS: the shipped heads drafting from their ROWS most frequent draft-vocabulary entries; heads~F: their
    # greedy chains stopping below chain probability F (0: never) instead of heads_cpu.MIN_CONFIDENCE; heads#NAME
    # (and heads#NAME~F): the heads of another file
    floors = [float(f) for f in filter(None, args.heads_floor.split(","))]
    for rows in filter(None, args.heads_rows.split(",")):
        add_heads(engine, f"@{rows}", draft_rows=int(rows))
    for floor in floors:
        add_heads(engine, f"~{floor:g}", min_confidence=floor)
    for item in args.heads_file:
        name, _, path = item.partition("=")
        for floor in [None, *floors]:
            add_heads(engine, f"#{name}" + ("" if floor is None else f"~{floor:g}"), Path(path), min_confidence=floor)
    if args.heads_float:
        add_heads(engine, "%float", cpu_blocks=False)
    if args.eagle_mxfp4:
        from specchat.engine.drafters.base import make_drafter

        engine.drafters["eagle%mxfp4"] = quantized = make_drafter("eagle", engine)
        quantized.follow_weights("mxfp4")
    for heads_k in filter(None, args.hybrid_heads_k.split(",")):
        from specchat.engine.drafters.hybrid import NgramThenHeads

        engine.drafters[f"ngram+heads/{heads_k}"] = NgramThenHeads(engine.drafter("heads"), heads_k=int(heads_k))
    categories = args.categories.split(",")
    by_category = {c: [p for p in load_prompt_set("eval", (c,))] for c in categories}
    prompts = [p for c in categories for p in by_category[c][: args.per_category or None]]
    timed_prompts = [p for c in categories for p in by_category[c][: args.timed_per_category]]
    if args.free_form:
        from cpu_peers import PROMPTS as FREE

        timed_prompts += [
            {"id": f"free{i}", "category": "free", "messages": [{"role": "user", "content": text}]}
            for i, text in enumerate(FREE)
        ]
        categories.append("free")
    configs = ["none", *(c for c in args.configs.split(",") if c != "none")]
    timed = ["none", *(c for c in args.timed.split(",") if c and c != "none")] if args.timed else []

    t0 = time.perf_counter()
    cells, same_plain = acceptance_pass(engine, prompts, configs, acts, args.max_tokens)
    print(
        f"acceptance pass: {len(prompts)} prompts x {len(configs)} configs x {acts} in {time.perf_counter() - t0:.0f} s"
    )
    timed_pairs = [(act, c) for act in acts for c in timed]
    speed = speed_pass(engine, timed_prompts, timed_pairs, args.max_tokens, args.repeats) if timed else {}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{args.dtype}, greedy, {args.max_tokens} new tokens, commit {commit}"
    )
    print(
        "| category | activations | drafter | k | acceptance | tokens/step | same as plain | tok/s | vs plain "
        f"| vs {acts[0]} plain |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    records = []
    for category in [*categories, "all"]:
        for act in acts:
            # A timed configuration left out of the acceptance pass still gets its row (tok/s only).
            for config in [*configs, *(c for c in timed if c not in configs)]:
                stats, same, total = cells.get((category, act, config), (SpecStats(), 0, 0))
                spec = spec_of(config)
                tok_s = speed.get((category, act, config))
                base, first = speed.get((category, act, "none")), speed.get((category, acts[0], "none"))
                acc = f"{stats.acceptance_rate:.2f}" if stats.drafted else "-"
                tps = f"{stats.tokens_per_step:.2f}" if total else "-"
                speed_cols = f"{tok_s:.1f} | {tok_s / base:.2f}x | {tok_s / first:.2f}x" if tok_s and base else "| |"
                k = "auto" if spec.k is None else spec.k
                row = f"| {category} | {act} | {spec.drafter} | {k} | {acc} | {tps} | {same}/{total} | {speed_cols} |"
                print(row)
                records.append(
                    {"category": category, "act": act, "config": config, "same": same, "prompts": total}
                    | {"tok_s": tok_s}
                    | (stats.to_json() if total else {})
                )
    if len(acts) > 1:
        counts = ", ".join(f"{c} {same_plain[c]}" for c in [*categories, "all"])
        print(f"\nplain greedy tokens equal under {' and '.join(acts)} (prompts): {counts}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "commit": commit, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
