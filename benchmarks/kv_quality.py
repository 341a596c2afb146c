"""KV page formats on the default model: bytes per token, perplexity through the real paged cache, and how many
greedy tokens agree with the bf16-KV run.

    python benchmarks/kv_quality.py [--texts dev,heldout,prose] [--tokens 64] [--device cpu]

Perplexity is `specchat perplexity`'s sliding window (context 1024, stride 512): every scored token reads its
whole context, itself included, back from the pages, so each variant's quantization applies as in a chat.
Greedy agreement runs the eval split of the shipped prompt set (specchat/data/prompts) concurrently, 64 new
tokens each, and counts the tokens equal to the bf16-KV run's before the first difference. The model weights
are the GGUF's (dequantized, float32); only the KV pages change between variants. Defaults are chosen on the
development text; the held-out text is only reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from datetime import date
from importlib import resources

import torch

from specchat.cli.perplexity import perplexity
from specchat.config import EngineConfig, SamplingParams
from specchat.engine.engine import Engine

TEXTS = {"dev": "dev_queue.txt", "heldout": "heldout_textwrap.txt", "prose": "heldout_langref.txt"}
VARIANTS = {  # name -> (page format, rotate, MXFP4 scale rule)
    "bf16": ("bf16", False, "mse"),
    "fp32": ("fp32", False, "mse"),
    "fp16": ("fp16", False, "mse"),
    "mxfp4": ("mxfp4", True, "mse"),
    "mxfp4 no-rotation": ("mxfp4", False, "mse"),
    "mxfp4 ocp-rule": ("mxfp4", True, "ocp"),
    "mxfp4 ocp-rule no-rotation": ("mxfp4", False, "ocp"),
    "k8v4": ("k8v4", True, "mse"),
    "k8v4 no-rotation": ("k8v4", False, "mse"),
}


def eval_prompts() -> list[tuple[str, list[dict]]]:
    folder = resources.files("specchat").joinpath("data", "prompts")
    prompts = []
    for name in sorted(p.name for p in folder.iterdir() if p.name.endswith(".jsonl")):
        for line in folder.joinpath(name).read_text().splitlines():
            record = json.loads(line)
            if record["split"] == "eval":
                prompts.append((name.removesuffix(".jsonl"), record["messages"]))
    return prompts


def greedy_outputs(engine: Engine, prompts: list[list[dict]], tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    handles = [engine.submit(messages, sampling) for messages in prompts]
    return [h.result().token_ids for h in handles]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", default="dev,heldout")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--baseline", default="bf16", help="the variant greedy agreement and ratios are counted against"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    engine = Engine.load(EngineConfig(device=args.device, kv_memory=1 << 30))
    c = engine.model.cfg
    texts = {
        name: engine.tokenizer.encode(resources.files("specchat").joinpath("data", "text", TEXTS[name]).read_text())
        for name in args.texts.split(",")
    }
    prompts = eval_prompts()
    results, baseline_tokens = {}, None
    for name in args.variants.split(","):
        fmt, rotate, rule = VARIANTS[name]
        engine.pool.convert(fmt, rotate=rotate, rule=rule)
        engine.pool.clear_prefix_cache()
        t0 = time.perf_counter()
        row = {"bytes_per_token": engine.pool.bytes_per_token}
        for text, ids in texts.items():
            row[f"ppl_{text}"] = perplexity(engine, ids, 1024, 512).ppl
        outputs = greedy_outputs(engine, [m for _, m in prompts], args.tokens)
        if name == args.baseline:
            baseline_tokens = outputs
        if baseline_tokens is not None:
            agree = [agreement(o, b) for o, b in zip(outputs, baseline_tokens, strict=True)]
            row["agree_mean"] = sum(agree) / len(agree)
            row["identical"] = sum(a == args.tokens for a in agree)
            row["agree_by_category"] = {
                cat: sum(a for (c_, _), a in zip(prompts, agree, strict=True) if c_ == cat)
                / sum(c_ == cat for c_, _ in prompts)
                for cat in sorted({c_ for c_, _ in prompts})
            }
        row["seconds"] = time.perf_counter() - t0
        results[name] = row
        print(name, json.dumps(row), flush=True)

    base = results[args.baseline]
    print(
        f"\n{date.today()} · {platform.machine()} {args.device} · commit {commit} · model {c.num_layers} layers, "
        f"{c.num_kv_heads} KV heads, head_dim {c.head_dim} · {len(prompts)} eval prompts x {args.tokens} greedy tokens\n"
    )
    head = f"| KV pages | bytes/token | vs {args.baseline} |"
    for text in texts:
        head += f" ppl {text} | vs {args.baseline} |"
    head += " greedy tokens agreeing (mean of 64) | identical outputs |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for name, row in results.items():
        line = f"| {name} | {row['bytes_per_token']:,} | {row['bytes_per_token'] / base['bytes_per_token'] - 1:+.1%} |"
        for text in texts:
            ppl = row[f"ppl_{text}"]
            line += f" {ppl:.3f} | {ppl / base[f'ppl_{text}'] - 1:+.2%} |"
        line += f" {row.get('agree_mean', float('nan')):.1f} | {row.get('identical', '-')}/{len(prompts)} |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "date": str(date.today()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
