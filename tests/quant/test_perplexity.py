"""`specchat perplexity`: the sliding window scores every token once, and agrees with one plain forward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from specchat.cli import main
from specchat.cli.perplexity import perplexity, sliding_windows, split_chunk
from specchat.engine.runner import StepBatch


@pytest.mark.parametrize(("n", "context", "stride"), [(10, 4, 2), (10, 4, 4), (9, 16, 8), (100, 32, 7)])
def test_windows_score_each_token_once_with_enough_history(n: int, context: int, stride: int) -> None:
    scored = []
    for begin, score_from, end in sliding_windows(n, context, stride):
        assert end - 1 - begin <= context and begin < score_from < end  # reads ids[begin:end - 1]
        assert begin == 0 or score_from - begin >= context - stride  # history of the first scored token
        scored += range(score_from, end)
    assert scored == list(range(1, n))


def test_perplexity_equals_one_full_forward_when_the_text_fits(engine) -> None:
    ids = engine.tokenizer.encode("class TextWrapper:\n    def __init__(self, width=70):\n        self.width = width\n")
    engine.pool.add(-2, [])
    try:
        logits = engine.runner.forward(StepBatch([-2], [ids[:-1]], [0], [len(ids) - 1])).logits[0]
    finally:
        engine.pool.free(-2)
    nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).double().sum()
    result = perplexity(engine, ids, context=256, stride=128)
    assert result.tokens == len(ids) - 1
    assert result.ppl == pytest.approx(math.exp(float(nll) / (len(ids) - 1)), rel=1e-5)


def test_split_chunk_keeps_tokens_positions_and_logit_rows() -> None:
    feed = list(range(10))
    assert split_chunk(feed, 5, 3, 4) == [([0, 1, 2, 3], 5, 0), ([4, 5, 6, 7], 9, 1), ([8, 9], 13, 2)]
    assert split_chunk(feed, 5, 10, 4) == [([0, 1, 2, 3], 5, 4), ([4, 5, 6, 7], 9, 4), ([8, 9], 13, 2)]
    assert split_chunk(feed, 0, 0, 64) == [(feed, 0, 0)]


def test_chunked_perplexity_scores_the_same_tokens(engine) -> None:
    """Forwards of at most 5 tokens read the same context from the pages: the same perplexity up to rounding."""
    ids = engine.tokenizer.encode("class TextWrapper:\n    def __init__(self, width=70):\n        self.width = width\n")
    whole = perplexity(engine, ids, context=16, stride=8)
    chunked = perplexity(engine, ids, context=16, stride=8, chunk=5)
    assert chunked.tokens == whole.tokens and chunked.ppl == pytest.approx(whole.ppl, rel=1e-4)


def test_cli_json(tiny_model_dir, tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20)
    args = ["perplexity", str(tiny_model_dir), "--file", str(text), "--device", "cpu", "--json", "--context", "64"]
    result = CliRunner().invoke(main, [*args, "--stride", "32"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    assert set(record) == {"ppl", "tokens"} and record["ppl"] > 1.0 and record["tokens"] > 100
    bad = CliRunner().invoke(main, [*args, "--stride", "65"])
    assert bad.exit_code == 1 and "stride must be in" in bad.output


def test_a_context_past_the_models_runs_at_the_models_and_says_so(engine) -> None:
    ids = engine.tokenizer.encode("class TextWrapper:\n    def __init__(self, width=70):\n")
    limit = engine.model.cfg.max_position
    result = perplexity(engine, ids, context=limit + 1000, stride=limit + 500)
    assert (result.context, result.stride) == (limit, limit)
    assert result.ppl == pytest.approx(perplexity(engine, ids, context=limit, stride=limit).ppl, rel=1e-6)
