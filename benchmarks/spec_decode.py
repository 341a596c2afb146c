"""Speculative decoding on the default model, per drafter and k, over the shipped prompt set's eval split.

Batch 1 and greedy, like Spec-Bench: each prompt runs alone once per configuration, all configurations of a
prompt back to back (in a rotating order) so that a busy machine slows them alike. Reported per category:
acceptance rate, tokens per step (SpecStats definitions), decode tok/s and the ratio to plain decoding in the
same run. Every configuration's tokens are checked against plain greedy decoding (lossless).

    python benchmarks/spec_decode.py --configs none,ngram:4,heads:4 --per-category 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.engine.stats import SpecStats
from specchat.engine.train_heads import CATEGORIES, load_prompt_set

DEFAULT_CONFIGS = "none,ngram:2,ngram:4,ngram:6,heads:1,heads:2,heads:3,heads:4,heads:5"


@dataclass
class Cell:
    """One (category, configuration): SpecStats merged over prompts, decode time and token counts."""

    stats: SpecStats = field(default_factory=SpecStats)
    decode_s: list[float] = field(default_factory=list)  # per repeat, summed over prompts
    tokens: int = 0  # decoded tokens (after the first) of one repeat
    mismatches: int = 0  # prompts whose tokens differ from plain greedy


def parse_config(text: str) -> tuple[str, int | None]:
    """'none' | 'DRAFTER:K' | 'DRAFTER:auto' -> (drafter, k)."""
    if text == "none":
        return "none", 0
    drafter, _, k = text.rpartition(":")
    return drafter, None if k == "auto" else int(k)


def run_one(engine: Engine, messages: list[dict], drafter: str, k: int | None, max_tokens: int):
    spec = SpecParams(drafter=drafter, k=k) if drafter != "none" else SpecParams(drafter="none", k=0)
    return engine.submit(messages, SamplingParams(max_tokens=max_tokens), spec).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated: none, DRAFTER:K, DRAFTER:auto")
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--per-category", type=int, default=4, help="eval prompts per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="tok/s is the median over repeats")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = Engine.load(EngineConfig(model=args.model, device="cpu", dtype=args.dtype))
    configs = [c.strip() for c in args.configs.split(",")]
    if "none" not in configs:
        configs.insert(0, "none")
    categories = args.categories.split(",")
    prompts = [p for p in load_prompt_set("eval", tuple(categories))]
    prompts = [p for c in categories for p in [q for q in prompts if q["category"] == c][: args.per_category]]

    cells: dict[tuple[str, str], Cell] = defaultdict(Cell)
    for repeat in range(args.repeats):
        times: dict[tuple[str, str], float] = defaultdict(float)
        for n, prompt in enumerate(prompts):
            order = configs[n % len(configs) :] + configs[: n % len(configs)]
            results = {}
            for config in order:
                drafter, k = parse_config(config)
                results[config] = run_one(engine, prompt["messages"], drafter, k, args.max_tokens)
            for config, fin in results.items():
                cell = cells[(prompt["category"], config)]
                times[(prompt["category"], config)] += fin.decode_s
                if repeat == 0:
                    cell.stats.merge(fin.stats)
                    cell.tokens += max(0, len(fin.token_ids) - 1)
                    cell.mismatches += fin.token_ids != results["none"].token_ids
            print(f"repeat {repeat + 1} prompt {n + 1}/{len(prompts)} {prompt['id']}", flush=True)
        for key, seconds in times.items():
            cells[key].decode_s.append(seconds)

    rows = []
    for category in [*categories, "all"]:
        for config in configs:
            if category == "all":
                cell = Cell()
                for c in categories:
                    part = cells[(c, config)]
                    cell.stats.merge(part.stats)
                    cell.tokens += part.tokens
                    cell.mismatches += part.mismatches
                    prev = cell.decode_s or [0.0] * len(part.decode_s)
                    cell.decode_s = [a + b for a, b in zip(prev, part.decode_s, strict=True)]
            else:
                cell = cells[(category, config)]
            rows.append((category, config, cell))
    base = {cat: statistics.median(cell.decode_s) / max(cell.tokens, 1) for cat, cfg, cell in rows if cfg == "none"}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"torch threads {torch.get_num_threads()}, {args.dtype}, commit {commit}"
    )
    print("| category | drafter | k | acceptance | tokens/step | tok/s | vs plain | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    records = []
    for category, config, cell in rows:
        s = cell.stats
        drafter, k = parse_config(config)
        tok_s = cell.tokens / statistics.median(cell.decode_s) if cell.decode_s and cell.tokens else 0.0
        ratio = base[category] * tok_s if tok_s else 0.0
        n_prompts = len([p for p in prompts if category in ("all", p["category"])])
        same = f"{n_prompts - cell.mismatches}/{n_prompts}"
        acc = f"{s.acceptance_rate:.2f}" if s.drafted else "-"
        print(
            f"| {category} | {drafter} | {'auto' if k is None else k} | {acc} | {s.tokens_per_step:.2f} | "
            f"{tok_s:.1f} | {ratio:.2f}x | {same} |"
        )
        records.append(
            {"category": category, "config": config, "tok_s": tok_s, "ratio": ratio, "same_tokens": same, **s.to_json()}
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "commit": commit, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()
