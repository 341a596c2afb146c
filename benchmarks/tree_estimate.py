"""Would tree drafting pay? The heads' tokens per step as a chain (one draft per depth) against trees that keep the
top n_d drafts at depth d, teacher-forced on the target's own greedy answers (issue 13: "tree drafting only if a
measured case prefers it").

    PYTHONPATH=. python benchmarks/tree_estimate.py --prompts benchmarks/session_prompts.txt
    PYTHONPATH=. python benchmarks/tree_estimate.py --prompts eval --widths 1,1,1,1 3,1,1,1 3,2,1,1

The target answers each prompt greedily (--max-tokens), then one forward over each prompt + answer keeps the
hidden state at every answer position t. Head d, fed the true tokens before it (the drafts a tree would have
kept on its right branch), ranks the target's token x_{t+1+d}; a tree of widths (n_1 .. n_k) accepts depth d
where every head up to d ranked its token below n_d. Tokens per step are those of a greedy run over each answer
(`greedy_run_tokens_per_step`: a step at position i emits its accepted drafts + 1 and the next starts after them);
draft rows are what a step verifies per request beyond its newest token (n_1 + n_1 n_2 + ...). On the branch
a greedy run accepts, every draft so far equals the true token, so this is what a tree of full widths accepts
(one cut to a row budget accepts less); widths 1,1,... are the shipped chain, ungated.
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path

import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.drafters.base import DATA_DIR
from specchat.engine.drafters.heads import DraftHeads, DraftVocabOutput
from specchat.engine.engine import Engine
from specchat.engine.sequence import Finished
from specchat.engine.train_heads import greedy_run_tokens_per_step, load_prompt_set, tapped_forward

DEFAULT_WIDTHS = ["1,1,1,1", "2,1,1,1", "3,1,1,1", "2,2,1,1", "3,2,1,1", "3,2,2,1", "4,2,2,1", "5,3,2,1"]


def prompt_messages(spec: str) -> list[list[dict]]:
    """'eval' / 'train': the shipped prompt set's split; otherwise a file of one user prompt per line."""
    if spec in ("eval", "train"):
        return [p["messages"] for p in load_prompt_set(spec)]
    lines = Path(spec).read_text().splitlines()
    return [[{"role": "user", "content": line.strip()}] for line in lines if line.strip()]


def greedy_answers(engine: Engine, prompts: list[list[dict]], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per prompt, all submitted at once."""
    handles = {}
    for messages in prompts:
        handle = engine.submit(messages, SamplingParams(max_tokens=max_tokens), SpecParams(drafter="none", k=0))
        handles[handle.request_id] = messages
    answers = {}
    while engine.scheduler.has_work():
        for event in engine.step():
            if isinstance(event, Finished):
                answers[event.request_id] = event.token_ids
    return [(engine.encode_prompt(messages), answers[rid]) for rid, messages in handles.items()]


@torch.no_grad()
def draft_ranks(engine: Engine, heads: DraftHeads, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """[positions, K]: at each answer position t, head d's rank of x_{t+1+d} among its draft logits (fed the true
    x_{t+1} .. x_{t+d}); a huge rank where the token is outside the draft vocabulary or past the answer."""
    model, K = engine.model, heads.cfg.num_heads
    tap = heads.cfg.tap
    seq = prompt + answer
    hidden = tapped_forward(engine, [seq], [1], tap).hidden[0][tap].float()
    first, last = len(prompt) - 1, len(seq) - 1
    on = partial(torch.arange, device=hidden.device)  # every index on the model's device (--device cuda)
    padded = torch.tensor(seq + [-1] * (K + 1), device=hidden.device)
    windows = padded[on(first + 1, last + 1)[:, None] + on(K + 1)]  # x_{t+1} .. x_{t+1+K}
    prev = model.embed(windows[:, :-1].clamp_min(0)).transpose(0, 1).float() if heads.cfg.sequential else None
    logits = DraftVocabOutput(model, heads.draft_vocab)(heads.teacher_forced(hidden[first:last], prev))  # [K, n, Vd]
    index = torch.full((model.cfg.vocab_size,), -1, dtype=torch.long, device=hidden.device)
    index[heads.draft_vocab] = on(len(heads.draft_vocab))
    truth = windows[:, 1:].T  # [K, n]
    at = index[truth.clamp_min(0)]
    score = logits.gather(-1, at.clamp_min(0)[..., None])
    ranks = (logits > score).sum(-1)
    ranks[(at < 0) | (truth < 0)] = 1 << 30
    return ranks.T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="benchmarks/session_prompts.txt", help="eval, train or a file")
    ap.add_argument("--heads", type=Path, default=None, help="a heads file (default: the shipped ones)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", nargs="+", default=DEFAULT_WIDTHS, help="trees as n_1,n_2,...; 1,1,.. is the chain")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    engine = Engine.load(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    heads, _ = DraftHeads.load(args.heads or DATA_DIR / "heads" / f"{args.model}.safetensors")
    heads = heads.to(engine.device)
    prompts = prompt_messages(args.prompts)
    ranks = [draft_ranks(engine, heads, p, a).cpu() for p, a in greedy_answers(engine, prompts, args.max_tokens)]
    every = torch.cat(ranks)
    print(f"{args.prompts}: {len(prompts)} prompts, {len(every)} answer positions, {args.max_tokens} tokens each")
    print("| head | top-1 | top-2 | top-3 | top-5 |\n| ---: | ---: | ---: | ---: | ---: |")
    for d in range(heads.cfg.num_heads):
        shares = " | ".join(f"{float((every[:, d] < n).float().mean()):.3f}" for n in (1, 2, 3, 5))
        print(f"| {d + 1} | {shares} |")
    right = (every < 1).long().cumprod(-1).sum(0).tolist()  # positions whose chain is right through head d
    rates = [right[d] / max(1, right[d - 1] if d else len(every)) for d in range(len(right))]
    print("chain acceptance by depth (`bench --synthetic --acceptance`):", ",".join(f"{r:.3f}" for r in rates))
    print("\n| widths | draft rows | tokens per step |\n| --- | ---: | ---: |")
    for spec in args.widths:
        widths = [int(n) for n in spec.split(",")]
        k, bound = len(widths), torch.tensor(widths)
        runs = [(r[:, :k] < bound).long().cumprod(-1).sum(-1) for r in ranks]
        rows = sum(math.prod(widths[: d + 1]) for d in range(k))
        print(f"| {spec} | {rows} | {greedy_run_tokens_per_step(runs, k):.2f} |")


if __name__ == "__main__":
    main()
