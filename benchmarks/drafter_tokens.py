"""Tokens per step of each drafter on a prompt set, one request at a time (CPU by default), greedy.

    PYTHONPATH=. python benchmarks/drafter_tokens.py [--prompts benchmarks/session_prompts.txt | eval]
        [--drafters heads,ngram,ngram+heads] [--k 4] [--max-tokens 128]

Each drafter answers every prompt through Engine.submit at a fixed k with its defaults on the device (on the CPU
the heads' confidence gate and the hybrid's heads length apply); tokens per step = tokens emitted by decode steps
/ decode steps, over all prompts. Speed is not measured here (benchmarks/spec_decode.py), only what drafts buy.
"""

from __future__ import annotations

import argparse

from tree_estimate import prompt_messages  # (benchmarks/, first on sys.path when run as a script)

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.engine.sequence import StepEvent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="benchmarks/session_prompts.txt", help="eval, train or a file")
    ap.add_argument("--drafters", default="heads,ngram,ngram+heads")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    engine = Engine.load(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    prompts = prompt_messages(args.prompts)
    print(f"| {args.prompts} | tokens per step (k = {args.k}) |\n| --- | ---: |")
    for drafter in args.drafters.split(","):
        steps = tokens = 0
        for messages in prompts:
            spec = SpecParams(drafter=drafter, k=args.k)
            for event in engine.generate(messages, SamplingParams(max_tokens=args.max_tokens), spec=spec):
                if isinstance(event, StepEvent):
                    steps, tokens = steps + 1, tokens + event.record.emitted
        print(f"| {drafter} | {tokens / steps:.2f} |")


if __name__ == "__main__":
    main()
