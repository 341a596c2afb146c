"""`specchat perplexity`: how well a model (and its weight / KV formats) predicts a text, like llama.cpp's tool.

Sliding window (as in HF transformers' perplexity guide): windows of `context` tokens start every `stride`
tokens; each window scores only the predictions no earlier window made, so every token after the first is
scored exactly once, with at least context - stride tokens of history (all there is in the first window).

    perplexity = exp(mean over scored tokens of -log p(token | history))

Each window runs through the engine's own model and KV pool, in two forwards: the history first, then the
scored tokens, which read their whole context back from the KV pages. So the weight format (`--weights`) and
the page format (`--kv`) apply exactly as they do when chatting. `--chunk N` feeds at most N tokens a forward
instead: on the CPU, 64 or fewer go through the GGUF block kernels (--cpu-act) as decoding does, token by token
bit for bit (their rows are batch-independent), where a longer chunk takes the float GEMM of a prompt's prefill.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import click

from specchat.cli.inputs import read_nonempty_text
from specchat.cli.options import StderrProgress, engine_config, model_options
from specchat.errors import ConfigError, KVCacheFullError, PromptError

HELD_OUT_TEXT = "heldout_textwrap.txt"  # specchat/data/text: never calibrated or tuned on
DEFAULT_CONTEXT = 1024
DEFAULT_STRIDE = DEFAULT_CONTEXT // 2  # the CLI's: half the window that runs
LONG_TEXT_CHARS = 2_000_000  # texts past this say they are being tokenized (about 0.9 s a MB, 2 idle cores)
PPL_SEQ_ID = -1  # the pool id of the window being scored; negative ids never collide with requests


@dataclass(slots=True)
class PerplexityResult:
    ppl: float
    tokens: int  # tokens scored
    nll_sum: float  # sum of -log p over them (nats)
    context: int  # the window that ran: the one asked, at most the model's context
    stride: int


def held_out_text() -> str:
    return resources.files("specchat").joinpath("data", "text", HELD_OUT_TEXT).read_text()


def sliding_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, score_from, end) per window over n tokens: the model reads ids[begin:end - 1] (at most
    `context` tokens) and scores its predictions of ids[score_from:end]."""
    windows, scored_to = [], 1  # token 0 has no history: it is never scored
    for begin in range(0, n - 1, stride):
        end = min(begin + context + 1, n)
        if end > scored_to:
            windows.append((begin, scored_to, end))
            scored_to = end
        if end == n:
            break
    return windows


def split_chunk(feed: list[int], start: int, rows: int, size: int) -> list[tuple[list[int], int, int]]:
    """One forward's (feed, start position, trailing logit rows) as forwards of at most `size` tokens."""
    end = start + len(feed)
    return [
        (feed[a - start : a - start + size], a, max(0, min(a + size, end) - max(a, end - rows)))
        for a in range(start, end, size)
    ]


def perplexity(
    engine, ids: list[int], context: int, stride: int | None = None, progress=None, chunk: int | None = None
) -> PerplexityResult:
    """Perplexity of `engine`'s model on token ids, windows of `context` tokens (at most the model's) every `stride`
    tokens (None: half the window); `chunk`: at most that many tokens a forward (None: the history and the scored
    tokens in one forward each)."""
    import torch

    from specchat.engine.runner import StepBatch

    if stride is not None and not 0 < stride <= context:
        raise ConfigError(f"stride must be in [1, context = {context}], got {stride}")
    if len(ids) < 2:
        raise PromptError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    context = min(context, engine.model.cfg.max_position)
    stride = max(1, context // 2) if stride is None else min(stride, context)
    runner, pool = engine.runner, engine.pool
    windows = sliding_windows(len(ids), context, stride)
    need = max(end - begin - 1 for begin, _, end in windows)  # tokens of KV the longest window reads back
    if need > pool.capacity_tokens:
        raise KVCacheFullError(
            f"a window of {need} tokens needs more KV cache than the pool holds ({pool.capacity_tokens} tokens): "
            "raise --kv-memory or lower --context"
        )
    nll, scored = 0.0, 0
    for w, (begin, score_from, end) in enumerate(windows):
        window = ids[begin:end]
        first_row = score_from - 1 - begin  # window position whose logits predict the first scored token
        split = max(1, first_row)  # history chunk [0, split), scored chunk [split, len - 1)
        chunks = [(window[:split], 0, split - first_row), (window[split:-1], split, len(window) - 1 - split)]
        if chunk is not None:
            chunks = [part for feed, start, rows in chunks for part in split_chunk(feed, start, rows, chunk)]
        pool.add(PPL_SEQ_ID, [])
        try:
            logits = torch.cat(
                [
                    runner.forward(StepBatch([PPL_SEQ_ID], [feed], [start], [rows])).logits[0]
                    for feed, start, rows in chunks
                    if feed
                ]
            )  # [scored, vocab] fp32
        finally:
            pool.free(PPL_SEQ_ID)
        targets = torch.tensor(ids[score_from:end], device=logits.device)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
        nll -= float(logprobs.double().sum())
        scored += len(targets)
        if progress:
            progress("perplexity", w + 1, len(windows))
    return PerplexityResult(math.exp(nll / scored), scored, nll, context, stride)


@click.command("perplexity")
@model_options
@click.option(
    "--file",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="text to score (default: the held-out text shipped in specchat/data/text)",
)
@click.option("--context", type=int, default=DEFAULT_CONTEXT, show_default=True, help="tokens per window")
@click.option("--stride", type=int, default=None, help="tokens between windows [default: half of --context]")
@click.option(
    "--chunk",
    type=click.IntRange(min=1),
    default=None,
    help="at most N tokens a forward (CPU: <= 64 scores through the block kernels, as decoding runs)",
)
@click.option("--json", "as_json", is_flag=True, help='print {"ppl", "tokens"} as JSON')
def perplexity_command(model, device, dtype, weights, text_file, context, stride, chunk, as_json) -> None:
    """Perplexity of MODEL (default: smollm2-135m) on a text, through the engine's model and KV cache."""
    from specchat.engine.engine import Engine

    if context <= 1:
        raise ConfigError(f"--context must be > 1, got {context}")
    if stride is not None and not 0 < stride <= context:
        raise ConfigError(f"--stride must be in [1, --context = {context}], got {stride}")
    text = read_nonempty_text(text_file, "--file") if text_file else held_out_text()
    config = engine_config(model, device, dtype, weights=weights)  # --kv and --kv-memory: model_options
    engine = Engine.load(config, progress=StderrProgress())
    if len(text) >= LONG_TEXT_CHARS:  # ~1 s a MB: say what the wait before the progress bar is
        click.echo(f"specchat: tokenizing {len(text) / 1e6:.1f} MB of text...", err=True)
    ids = engine.tokenizer.encode(text)
    if len(ids) < 2:  # perplexity() refuses it too, without the file's name
        raise PromptError(f"--file {text_file}: the text is {len(ids)} token; perplexity needs at least 2")
    # (no --stride: half the window that runs, so --context 64 alone is not refused for a default stride of 512)
    result = perplexity(engine, ids, context, stride, progress=StderrProgress(), chunk=chunk)
    window = result.context  # perplexity() keeps windows within the model's context
    if window < context:
        click.echo(f"specchat: --context {context} is past the model's {window}: used that", err=True)
    if len(ids) - 1 < window:  # one window, shorter than the one asked for: the number is not comparable
        note = (  # (a window is its context and the token after it)
            f"the text ({len(ids)} tokens) is shorter than one window ({window + 1} tokens: {window} of context and "
            "the next): it is scored as a single window"
        )
        click.echo(f"specchat: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps({"ppl": round(result.ppl, 4), "tokens": result.tokens}))
    else:
        click.echo(
            f"perplexity {result.ppl:.4f} over {result.tokens} tokens (context {result.context}, stride {result.stride})"
        )


def register(group: click.Group) -> None:
    group.add_command(perplexity_command)
