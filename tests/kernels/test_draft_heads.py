"""The heads' greedy chain in fused kernels (kernels/draft_heads_triton.py) against the plain chain, its
reference (`HeadsDrafter.plain_chain`). Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (fp32 only there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specchat.engine.drafters.heads import DraftHeads, HeadsConfig, HeadsDrafter
from specchat.engine.model import Transformer
from specchat.kernels import draft_heads
from tests.engine.test_fusion import CFG
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

# 300 tokens, 200 of them drafted: the draft rows end in a partial block of the argmax kernel
WIDE = dataclasses.replace(CFG, vocab_size=300)
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def drafter(dtype: torch.dtype, num_heads: int = 4) -> HeadsDrafter:
    torch.manual_seed(0)
    model = Transformer(WIDE).eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    vocab = torch.randperm(WIDE.vocab_size, generator=torch.Generator().manual_seed(0))[:200]
    heads = DraftHeads(HeadsConfig.for_model(model, num_heads), vocab)
    torch.manual_seed(1)
    for block in heads.blocks:
        torch.nn.init.normal_(block.down.weight, std=0.5)
        torch.nn.init.uniform_(block.state_norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(block.embed_norm.weight, 0.5, 1.5)
    return HeadsDrafter(heads, model.to(DEVICE, dtype), graphs=False, cpu_blocks=False)


def forced_logits(d: HeadsDrafter, hidden: torch.Tensor, prev: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The plain heads' draft logits [depth, B, Vd] at each position, fed `drafts` as their earlier tokens."""
    state, logits = hidden, []
    for i, block in enumerate(d.heads.blocks[: drafts.shape[1]]):
        state = block(state, d.embed(prev if i == 0 else drafts[:, i - 1]))
        logits.append(d.output(state))
    return torch.stack(logits)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("depth", [1, 4])
@torch.inference_mode()
def test_fused_chain_drafts_what_the_plain_chain_does(dtype, rows, depth):
    """fp32: the same drafts. Half types (the fused chain rounds the residual sum once, the plain chain twice): at
    each position a draft whose plain logit, fed the same earlier drafts, is within rounding of the best."""
    d = drafter(dtype)
    g = torch.Generator().manual_seed(rows)
    hidden = (torch.randn(rows, WIDE.hidden_size, generator=g) * 2).to(DEVICE, dtype)
    prev = torch.randint(0, WIDE.vocab_size, (rows,), generator=g).to(DEVICE)
    blocks = d.heads.blocks[:depth]
    assert draft_heads.supported(hidden, blocks, d.embed.weight, d.output.rows.weight)
    fused = d.greedy_chain(depth, hidden, prev)
    plain = d.plain_chain(depth, hidden, prev)
    assert fused.shape == plain.shape == (rows, depth) and fused.dtype == plain.dtype
    if dtype == torch.float32:
        assert torch.equal(fused, plain)
        return
    logits = forced_logits(d, hidden, prev, fused)  # [depth, B, Vd]
    # the drafts' places in the draft vocabulary
    at = torch.searchsorted(d.draft_vocab.sort().values, fused.T.contiguous())
    order = d.draft_vocab.sort().indices
    chosen = logits.gather(2, order[at].unsqueeze(-1)).squeeze(-1)
    assert (chosen >= logits.max(-1).values - 0.05 * logits.abs().max()).all()
    assert (fused == plain).float().mean() > 0.8


@kernel_test
@torch.inference_mode()
def test_fused_chain_takes_the_first_of_tied_logits():
    """Draft rows with the same logits (identical rows, in different argmax programs): the first is drafted, as
    torch.argmax takes the first. The tie is exact in any summation order: every row is zero but the tied ones,
    each a single +-1 (a dense row's logits differ in their last bits by where the row sits in a matmul's tile,
    under the interpreter's numpy as in a GPU's dot)."""
    d = drafter(torch.float32, num_heads=1)
    rows = d.output.rows.weight
    hidden = torch.randn(2, WIDE.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    prev = torch.tensor([1, 2], device=DEVICE)
    tied = (0, 64, rows.shape[0] - 1)  # block 0, the next block, and a partial block's last row
    with torch.no_grad():
        rows.zero_()
        for sign in (1.0, -1.0):  # the sign whose logit beats the zero rows' 0 for request 0
            rows[tied, 0] = sign
            if int(d.plain_chain(1, hidden, prev)[0, 0]) == int(d.draft_vocab[0]):
                break
    fused, plain = d.greedy_chain(1, hidden, prev), d.plain_chain(1, hidden, prev)
    assert torch.equal(fused, plain) and int(fused[0, 0]) == int(d.draft_vocab[0])


@kernel_test
@torch.inference_mode()
def test_fused_chain_drafts_tokens_of_its_vocabulary_from_nan_states():
    """From a state of NaN (what a graph's spoiled output likely gave it on the H200) the chain still drafts
    tokens of its vocabulary, as the plain chain does: a NaN logit is never the best, so the argmax's partial
    results hold indices in range (reading past them was an illegal memory access there)."""
    d = drafter(torch.float32)
    hidden = torch.full((3, WIDE.hidden_size), float("nan"), device=DEVICE)
    prev = torch.tensor([1, 2, 3], device=DEVICE)
    fused = d.greedy_chain(4, hidden, prev)
    assert torch.isin(fused, d.draft_vocab.to(DEVICE)).all()


def test_fused_chain_not_taken_where_it_does_not_run():
    """Parallel heads and a width that is not a whole number of dots take the plain chain; so does the CPU
    without the interpreter."""
    d = drafter(torch.float32)
    hidden = torch.zeros(1, WIDE.hidden_size, device=DEVICE)
    blocks, embed, rows = d.heads.blocks, d.embed.weight, d.output.rows.weight
    parallel = DraftHeads(dataclasses.replace(d.cfg, sequential=False)).blocks.to(DEVICE)
    assert not draft_heads.supported(hidden, parallel, embed, rows)
    assert not draft_heads.supported(hidden[:, :48], blocks, embed[:, :48], rows[:, :48])
    assert draft_heads.supported(hidden, blocks, embed, rows) == (DEVICE == "cuda" or draft_heads.INTERPRET)


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "kernel or fused_chain")
