"""The n-gram drafter's host cost per request and step at a given context length (issue 13: the drafters' host
work at many sessions on the GPU, where a step's host time is the step).

    PYTHONPATH=. python benchmarks/ngram_lookup.py [--contexts 300,4000,16000] [--steps 2000] [--vocab 50]

A request of CONTEXT prompt tokens (random over --vocab ids, so that n-grams repeat) grows by one token a step;
each step times `NgramDrafter.propose` for it at k = 4. Prints microseconds per propose, median of 3 runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import timeit

from specchat.engine.drafters.ngram import NgramDrafter
from specchat.engine.sequence import Sequence


def per_propose_us(context: int, steps: int, vocab: int, seed: int) -> float:
    rng = random.Random(seed)
    seq = Sequence.__new__(Sequence)  # only what a drafter reads: id, prompt, output
    seq.seq_id, seq.prompt_ids, seq.output_ids = 0, [rng.randrange(vocab) for _ in range(context)], []
    drafter = NgramDrafter()

    def step() -> None:
        seq.output_ids.append(rng.randrange(vocab))
        drafter.propose([seq], [4])

    step()  # the prompt's n-grams are indexed on the first call
    return timeit.timeit(step, number=steps) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="300,4000,16000")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--vocab", type=int, default=50)
    args = parser.parse_args()
    print("| context tokens | us per propose (median of 3) |")
    print("|---:|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        us = statistics.median(per_propose_us(context, args.steps, args.vocab, seed) for seed in range(3))
        print(f"| {context:,} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
