"""Would a datastore drafter pay beside the n-grams and the heads? Retrieval drafting (REST, He et al. 2024) drafts
from a store of text instead of the request's own context: here the target's own greedy answers to the train
prompts, indexed by n-gram, drafting the most frequent continuation of the longest matching tail, token by token.

    PYTHONPATH=. python benchmarks/datastore_estimate.py [--max-tokens 192] [--k 4] [--heads NAME=PATH ...] [--no-store]

The target answers every prompt of the shipped set greedily (train and eval, batched); the store indexes the train
answers. On each eval answer a greedy run at k is walked exactly: greedy verification emits the target's own
answer, so a step at answer position i emits its drafter's run of right drafts (at most k) + 1 and the next step
starts after them. The drafters: the n-gram prompt lookup (`NgramIndex`, as `ngram` drafts), the shipped heads
(ungated, teacher-forced ranks as benchmarks/tree_estimate.py: exact for the greedy chain), the store, orders of
them (the first that drafts anything drafts), and an oracle that takes the best one at every step. Prints tokens
per step over the eval split and per category. `--heads NAME=PATH` (repeatable) compares heads files on the same
answers, alone and after the n-grams; `--no-store` leaves the store out (and the train answers it needs).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Callable

from tree_estimate import draft_ranks, greedy_answers

from specchat.config import EngineConfig
from specchat.engine.drafters.base import DATA_DIR
from specchat.engine.drafters.heads import DraftHeads
from specchat.engine.drafters.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramIndex
from specchat.engine.engine import Engine
from specchat.engine.train_heads import load_prompt_set

STORE_MAX_N = 6  # the longest tail the store matches


class Datastore:
    """The n-grams (min_n..STORE_MAX_N) of a set of token sequences, each with every position that follows it."""

    def __init__(self, sequences: list[list[int]], min_n: int = 2) -> None:
        self.sequences, self.min_n = sequences, min_n
        self.follows: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        for s, ids in enumerate(sequences):
            for n in range(min_n, STORE_MAX_N + 1):
                for i in range(n, len(ids)):
                    self.follows[tuple(ids[i - n : i])].append((s, i))

    def draft(self, context: list[int], k: int, min_count: int, min_n: int) -> list[int]:
        """Up to k tokens: from the longest tail of at least min_n tokens the store holds, the continuation that
        at least min_count of its occurrences share, most frequent token first at each depth."""
        for n in range(min(STORE_MAX_N, len(context)), max(min_n, self.min_n) - 1, -1):
            places = self.follows.get(tuple(context[-n:]), [])
            drafted = []
            while len(drafted) < k and places:
                counts = Counter(self.sequences[s][i] for s, i in places if i < len(self.sequences[s]))
                if not counts or counts.most_common(1)[0][1] < min_count:
                    break
                token = counts.most_common(1)[0][0]
                drafted.append(token)
                places = [(s, i + 1) for s, i in places if i < len(self.sequences[s]) and self.sequences[s][i] == token]
            if drafted:
                return drafted
        return []


def right_run(truth: list[int], draft: list[int]) -> int:
    """How many drafts in a row equal the truth."""
    n = 0
    for a, b in zip(truth, draft, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--heads", action="append", default=[], help="NAME=PATH: heads to compare (default: shipped)")
    ap.add_argument("--no-store", dest="store", action="store_false", help="leave the datastore out")
    ap.add_argument("--device", default="cpu", help="where the target answers and the heads rank (cuda: faster)")
    args = ap.parse_args()
    k = args.k
    files = dict(spec.split("=", 1) for spec in args.heads) or {"": DATA_DIR / "heads" / f"{args.model}.safetensors"}

    # fp32 on every device: the CPU figures' dtype, and the heads' own (they rank in fp32 beside the target's taps)
    engine = Engine.load(EngineConfig(model=args.model, device=args.device, dtype="float32", max_running=64))
    train, evals = load_prompt_set("train") if args.store else [], load_prompt_set("eval")
    answers = greedy_answers(engine, [p["messages"] for p in train + evals], args.max_tokens)
    store = Datastore([answer for _, answer in answers[: len(train)]])
    cases = []  # (category, prompt ids, answer, each heads file's run at each answer position)
    heads = {name: DraftHeads.load(path)[0].to(engine.device) for name, path in files.items()}
    for prompt, (ids, answer) in zip(evals, answers[len(train) :], strict=True):
        runs = {
            name: (draft_ranks(engine, h, ids, answer) < 1).long().cumprod(-1).sum(-1).tolist()
            for name, h in heads.items()
        }
        cases.append((prompt["category"], ids, answer, runs))
    print(f"store: {len(train)} train answers, {sum(map(len, store.sequences))} tokens; eval: {len(cases)} answers, "
          f"up to {args.max_tokens} tokens, k = {k}")  # fmt: skip

    def ngram(context: list[int]) -> list[int]:
        index = NgramIndex(DEFAULT_MIN_N, DEFAULT_MAX_N)
        index.extend(context)
        return index.lookup(context, k)

    Runs = dict[str, int | None]  # drafter -> its run of right drafts at this step, None where it drafts nothing

    def runs_at(context: list[int], truth: list[int], heads_runs: dict[str, int]) -> Runs:
        drafts = {"ngram": ngram(context)}
        if args.store:
            drafts |= {"store": store.draft(context, k, 2, 2), "store4": store.draft(context, k, 3, 4)}
        runs = {name: right_run(truth, d) if d else None for name, d in drafts.items()}
        return runs | {f"heads{name}": run for name, run in heads_runs.items()}

    def first_that_drafts(*names: str) -> Callable[[Runs], int]:
        def run(r: Runs) -> int:
            return next((r[name] for name in names if r[name] is not None), 0)

        return run

    drafters: dict[str, Callable[[Runs], int]] = {"ngram": first_that_drafts("ngram")}
    for name in files:
        h = f"heads{name}"
        drafters |= {
            h: first_that_drafts(h),
            f"ngram, else {h} (ngram+heads)": first_that_drafts("ngram", h),
            f"oracle: the best of ngram and {h}": lambda r, h=h: max(r["ngram"] or 0, r[h]),
        }
        if args.store:
            drafters |= {
                f"ngram, else store, else {h}": first_that_drafts("ngram", "store", h),
                f"ngram, else store (n >= 4, 3 occurrences), else {h}": first_that_drafts("ngram", "store4", h),
                f"oracle: the best of ngram, {h} and store": lambda r, h=h: max(r["ngram"] or 0, r[h], r["store"] or 0),
            }
    if args.store:
        drafters["store (n >= 2, 2 occurrences)"] = first_that_drafts("store")
    print("\n| drafter | tokens per step | " + " | ".join(sorted({c for c, *_ in cases})) + " |")
    print("| --- | ---: |" + " ---: |" * len({c for c, *_ in cases}))
    seen: dict[tuple[int, int], Runs] = {}  # (case, position) -> every drafter's run there, drafted once
    for name, choose in drafters.items():
        emitted, steps = defaultdict(int), defaultdict(int)
        for n, (category, ids, answer, heads_runs) in enumerate(cases):
            i = 1  # the prompt's forward emits answer[0]; drafting starts at the first decode step
            while i < len(answer):
                if (n, i) not in seen:
                    at = {name: runs[i - 1] for name, runs in heads_runs.items()}
                    seen[n, i] = runs_at(ids + answer[:i], answer[i:], at)
                i += min(choose(seen[n, i]), k) + 1
                steps[category] += 1
            emitted[category] += len(answer) - 1
        overall = sum(emitted.values()) / sum(steps.values())
        per = " | ".join(f"{emitted[c] / steps[c]:.2f}" for c in sorted(emitted))
        print(f"| {name} | {overall:.2f} | {per} |")


if __name__ == "__main__":
    main()
