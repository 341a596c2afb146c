"""The draft heads read as Q8_0 blocks on the CPU (engine/drafters/heads_cpu.py) against their plain reference:
the quantizer against gguf's, the packed drafter's logits and greedy drafts against the same arithmetic in torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specchat.config import SamplingParams
from specchat.engine import cpu_fusion
from specchat.engine.cpu_weights import BlockLinear, quantize_q8_0
from specchat.engine.drafters import heads_cpu
from specchat.engine.drafters.heads import DraftHeads, HeadsConfig, HeadsDrafter
from specchat.engine.model import Transformer
from specchat.kernels import cpu_gemv, cpu_gemv_i8, cpu_ops
from tests.engine.test_drafters import FakeSeq
from tests.engine.test_fusion import CFG

pytestmark = pytest.mark.skipif(
    not (cpu_gemv.available() and cpu_ops.available()), reason="no C compiler for the CPU kernels"
)


def test_quantize_q8_0_matches_gguf_bytes():
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(0)
    weight = torch.randn(6, 96) * torch.tensor([1e-3, 0.1, 3.0]).repeat_interleave(32)  # blocks of three scales
    weight[2, 32:64] = 0.0  # an all-zero block: d = 0, codes 0
    codes, d = quantize_q8_0(weight)
    raw = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0).reshape(6, 3, 34)  # fp16 d + 32 codes
    assert np.array_equal(d.numpy(), raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert np.array_equal(codes.numpy(), raw[..., 2:].copy().view(np.int8).reshape(6, 96))
    assert float(d[2, 1]) == 0.0 and not codes[2, 32:64].any()


def packed_target() -> Transformer:
    """The tiny model with its lm_head read as Q8_0 blocks (its float weight their dequantization) and its norms
    the C kernel's, as the engine leaves a GGUF model whose output tensor is Q8_0 (pack_blocks, cpu_fusion.fuse)."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    codes, d = quantize_q8_0(model.lm_head.weight)
    model.lm_head = heads_cpu.block_linear(cpu_gemv.q8_dequantize(codes, d), (codes, d), "q8_0")
    cpu_fusion.fuse(model)
    return model


def random_heads(model: Transformer, num_heads: int = 4) -> DraftHeads:
    vocab = torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    heads = DraftHeads(HeadsConfig.for_model(model, num_heads), vocab)
    torch.manual_seed(1)
    for block in heads.blocks:
        torch.nn.init.normal_(block.down.weight, std=0.5)
    return heads


def reference_linear(x: torch.Tensor, linear: BlockLinear) -> torch.Tensor:
    """What the block kernel computes, in plain torch: int8 rows where the CPU has AVX512-VNNI or AVX2, else float."""
    ref = cpu_gemv_i8.q8_linear_ref if cpu_gemv_i8.available() else cpu_gemv.q8_linear_ref
    return ref(x, linear.codes, linear.d)


def reference_chain(drafter: HeadsDrafter, model: Transformer, hidden: torch.Tensor, prev: torch.Tensor, depth: int):
    """The packed drafter's greedy chain as plain torch: (drafts [B, depth], logits [depth, B, Vd])."""
    tokens, logits, state = [], [], hidden
    for block in drafter.heads.blocks[:depth]:
        eps = block.state_norm.eps
        u = torch.cat(
            [
                cpu_ops.rms_norm_ref(state, block.state_norm.weight, eps),
                cpu_ops.rms_norm_ref(model.embed(prev).float(), block.embed_norm.weight, eps),
            ],
            dim=-1,
        )  # [B, 2d]
        state = state + reference_linear(F.silu(reference_linear(u, block.up)), block.down)  # [B, d]
        norm = drafter.output.norm  # the target's final norm (a float32 copy of a bfloat16 target's)
        normed = cpu_ops.rms_norm_ref(state, norm.weight.float(), norm.eps)
        logits.append(reference_linear(normed, drafter.output.rows))  # [B, Vd]
        prev = drafter.draft_vocab[logits[-1].argmax(-1)]
        tokens.append(prev)
    return torch.stack(tokens, dim=1), torch.stack(logits)


def c_chain(drafter: HeadsDrafter, depth: int, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The packed drafter's greedy chain as its C call runs it for propose (ungated: every position) [B, depth]."""
    tokens, _ = heads_cpu.draft_chain(drafter, depth, list(hidden), prev.tolist(), floor=0.0)
    return torch.tensor(tokens, dtype=torch.long)


def test_packed_heads_draft_what_their_reference_computes():
    model = packed_target()
    heads = random_heads(model)
    plain = HeadsDrafter(heads, model, cpu_blocks=False)
    packed = HeadsDrafter(heads, model)
    assert type(plain.heads.blocks[0].up) is torch.nn.Linear  # the caller's heads stay float
    assert all(isinstance(b.up, BlockLinear) and isinstance(b.down, BlockLinear) for b in packed.heads.blocks)
    rows = packed.output.rows
    assert torch.equal(rows.codes, model.lm_head.codes[heads.draft_vocab])  # the target's own blocks, sliced
    assert torch.equal(rows.weight, plain.output.rows.weight)

    torch.manual_seed(2)
    hidden = torch.randn(8, CFG.hidden_size) * 2
    prev = torch.randint(0, CFG.vocab_size, (8,))
    with torch.inference_mode():
        chain = c_chain(packed, 4, hidden, prev)
        assert torch.equal(packed.greedy_chain(4, hidden, prev), chain)  # the modules' chain (the graphed path's)
        want, want_logits = reference_chain(packed, model, hidden, prev, 4)
        state = packed.heads.blocks[0](hidden, model.embed(prev))
        torch.testing.assert_close(packed.output(state), want_logits[0], rtol=1e-4, atol=1e-4)
        float_chain = plain.greedy_chain(4, hidden, prev)
    assert chain.tolist() == want.tolist()
    # the quantized heads mostly draft what the float ones do (on random heads: a loose check of the wiring)
    assert (chain == float_chain).float().mean() > 0.5


def test_packed_chain_equals_step_by_step_drafting():
    """The packed drafter's greedy chain runs as one C call (cpu_block.draft_chain); greedy_chain and the
    position-by-position path run the packed modules. The same calls in the same order: the same drafts at every
    depth and batch size, and from one position of the modules, taken apart, too."""
    model = packed_target()
    drafter = HeadsDrafter(random_heads(model), model)
    assert drafter.c_chain is not None
    calls = []
    real = heads_cpu.cpu_block.draft_chain
    heads_cpu.cpu_block.draft_chain = lambda *a: calls.append(a[1]) or real(*a)
    try:
        for batch, depth in ((1, 1), (3, 4), (8, 2), (2, 3)):
            torch.manual_seed(batch + depth)
            hidden = torch.randn(batch, CFG.hidden_size) * 2
            prev = torch.randint(0, CFG.vocab_size, (batch,))
            group = [FakeSeq(i, [1, int(p)], SamplingParams()) for i, p in enumerate(prev)]
            with torch.inference_mode():
                chain = c_chain(drafter, depth, hidden, prev)
                modules = drafter.greedy_chain(depth, hidden, prev)
                steps = drafter.draft_steps(group, hidden, prev, depth)
            assert chain.shape == (batch, depth) and chain.T.tolist() == [tokens for tokens, _ in steps]
            assert torch.equal(chain, modules)
    finally:
        heads_cpu.cpu_block.draft_chain = real
    assert calls == [1, 4, 2, 3]
    # one position's state from the C kernels' modules (silu in C) against the chain's first draft
    with torch.inference_mode():
        block, hidden, prev = drafter.heads.blocks[0], torch.randn(4, CFG.hidden_size), torch.arange(4)
        state = block(hidden, model.embed(prev))
        first = drafter.draft_vocab[drafter.output(state).argmax(-1)]
        assert torch.equal(c_chain(drafter, 1, hidden, prev)[:, 0], first)
        with pytest.raises(ValueError, match="outside the embedding"):
            c_chain(drafter, 1, hidden, torch.tensor([0, 1, 2, CFG.vocab_size]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_target_drafts_through_q8_0_blocks_too(dtype):
    """A target on torch's float linears (bfloat16 on a CPU with native bf16, or a float32 model without GGUF
    blocks): the heads and its draft-vocabulary rows are quantized to Q8_0 here and draft in float32, as one C
    call that widens a bfloat16 embedding a row at a time; the same drafts as the packed modules and their plain
    reference. --eager's float heads (cpu_blocks=False) stay the target's dtype."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval().to(dtype)
    heads = random_heads(model)
    assert heads_cpu.packable(model)
    packed, plain = HeadsDrafter(heads, model), HeadsDrafter(heads, model, cpu_blocks=False)
    assert type(plain.output.rows) is torch.nn.Linear and plain.output.rows.weight.dtype == dtype
    assert all(isinstance(b.up, BlockLinear) and b.up.weight.dtype == torch.float32 for b in packed.heads.blocks)
    rows = model.lm_head.weight[heads.draft_vocab[: heads_cpu.DRAFT_ROWS]].float()
    assert torch.equal(packed.output.rows.codes, quantize_q8_0(rows)[0])
    assert packed.output.norm.weight.dtype == torch.float32 and packed.output.norm is not model.norm
    assert packed.c_chain is not None and packed.gated_k == min(heads_cpu.FLOAT_GATED_K, heads.cfg.num_heads)
    assert packed.min_confidence == heads_cpu.FLOAT_MIN_CONFIDENCE

    torch.manual_seed(3)
    hidden = (torch.randn(6, CFG.hidden_size) * 2).to(dtype)  # the target's tapped rows, in its dtype
    prev = torch.randint(0, CFG.vocab_size, (6,))
    with torch.inference_mode():
        chain = c_chain(packed, 4, hidden, prev)
        wide = hidden.float()
        assert torch.equal(packed.greedy_chain(4, wide, prev), chain)
        want, _ = reference_chain(packed, model, wide, prev, 4)
        group = [FakeSeq(i, [1, int(p)], SamplingParams()) for i, p in enumerate(prev)]
        steps = packed.draft_steps(group, *packed.chain_inputs(list(hidden), prev.tolist()), 4)
    assert chain.tolist() == want.tolist() and chain.T.tolist() == [tokens for tokens, _ in steps]


def test_draft_rows_keep_the_most_frequent_entries_of_the_draft_vocabulary(monkeypatch):
    """The packed heads draft from the first heads_cpu.DRAFT_ROWS draft-vocabulary entries (the most frequent):
    output rows and drafts come from those only; the float heads keep them all unless asked."""
    model = packed_target()
    heads = random_heads(model)  # 40 draft-vocabulary entries
    monkeypatch.setattr(heads_cpu, "DRAFT_ROWS", 16)
    packed, plain = HeadsDrafter(heads, model), HeadsDrafter(heads, model, cpu_blocks=False)
    assert torch.equal(packed.draft_vocab, heads.draft_vocab[:16]) and len(plain.draft_vocab) == 40
    assert torch.equal(packed.output.rows.codes, model.lm_head.codes[heads.draft_vocab[:16]])
    trimmed = HeadsDrafter(heads, model, cpu_blocks=False, draft_rows=10)
    torch.manual_seed(4)
    hidden, prev = torch.randn(6, CFG.hidden_size) * 2, torch.randint(0, CFG.vocab_size, (6,))
    with torch.inference_mode():
        for drafter, rows in ((packed, 16), (trimmed, 10)):
            chain = drafter.greedy_chain(3, hidden, prev)
            assert set(chain.flatten().tolist()) <= set(heads.draft_vocab[:rows].tolist())


def test_ngram_then_heads_caps_packed_heads_at_the_cpu_depth():
    """On the CPU (packed heads) ngram+heads lets the heads draft heads_cpu.HYBRID_HEADS_K tokens where the n-grams
    miss; float heads draft the step's k unless told."""
    from specchat.engine.drafters.hybrid import NgramThenHeads

    model = packed_target()
    heads = random_heads(model)
    assert NgramThenHeads(HeadsDrafter(heads, model)).heads_k == heads_cpu.HYBRID_HEADS_K
    assert NgramThenHeads(HeadsDrafter(heads, model, cpu_blocks=False)).heads_k is None
    assert NgramThenHeads(HeadsDrafter(heads, model), heads_k=4).heads_k == 4


def test_confident_prefix_stops_where_the_chain_probability_falls_below_the_floor():
    assert heads_cpu.confident_prefix([1, 2, 3], [0.9, 0.5, 0.9], 0.4) == [1, 2, 3]  # 0.9, 0.45, 0.405
    assert heads_cpu.confident_prefix([1, 2, 3], [0.9, 0.5, 0.9], 0.5) == [1]
    assert heads_cpu.confident_prefix([1, 2], [0.1, 1.0], 0.2) == []
    assert heads_cpu.confident_prefix([1, 2], [float("nan"), 1.0], 0.0) == []  # NaN logits: no draft
    assert heads_cpu.confident_prefix([1, 2], [0.3, 0.9], 0.0) == [1, 2]


def test_packed_chain_reports_each_drafts_probability_and_propose_keeps_the_confident_ones():
    """draft_chain's probabilities are the heads' softmax over the draft vocabulary at each draft (the reference
    chain's logits); a greedy propose keeps each request's drafts while their product stays >= min_confidence."""
    model = packed_target()
    heads = random_heads(model)
    torch.manual_seed(6)
    hidden = torch.randn(5, CFG.hidden_size) * 2
    prev = torch.randint(0, CFG.vocab_size, (5,))
    drafter = HeadsDrafter(heads, model, min_confidence=0.0)
    with torch.inference_mode():
        tokens, confidence = heads_cpu.draft_chain(drafter, 4, list(hidden), prev.tolist())
        want, want_logits = reference_chain(drafter, model, hidden, prev, 4)
    assert tokens == want.tolist()
    probs = want_logits.softmax(-1).amax(-1).T  # [B, depth]
    torch.testing.assert_close(torch.tensor(confidence), probs, rtol=1e-5, atol=1e-6)
    with torch.inference_mode():  # every chain below the floor after the first draft: one position drafted
        first, first_conf = heads_cpu.draft_chain(drafter, 4, list(hidden), prev.tolist(), floor=1.01)
    assert first == [t[:1] for t in tokens] and first_conf == [c[:1] for c in confidence]
    seqs = [FakeSeq(i, [1, int(p)], SamplingParams(), hidden={CFG.num_layers - 1: hidden[i : i + 1]}) for i, p in
            enumerate(prev)]  # fmt: skip
    for floor in (0.0, 0.05, 0.2, 1.01):
        drafter.min_confidence = floor
        with torch.inference_mode():
            drafts = drafter.propose(seqs, [4, 4, 3, 2, 4])
        for b, draft in enumerate(drafts):
            kept = heads_cpu.confident_prefix(tokens[b], confidence[b], floor)[: [4, 4, 3, 2, 4][b]]
            assert draft.tokens == kept and draft.probs is None
        assert floor < 1.0 or all(d.tokens == [] for d in drafts)
    # a step mixing sampled requests in: the greedy ones still take the gated C chain, the sampled ones draft
    # position by position with the distribution they were drawn from
    drafter.min_confidence = 0.2
    sampled = SamplingParams(temperature=0.8, seed=3)
    mixed = [
        seq if b % 2 == 0 else FakeSeq(b, seq.all_ids, sampled, hidden=seq.hidden, generator=torch.Generator().manual_seed(b))
        for b, seq in enumerate(seqs)
    ]  # fmt: skip
    with torch.inference_mode():
        drafts = drafter.propose(mixed, [4, 4, 3, 2, 4])
    for b, draft in enumerate(drafts):
        if b % 2 == 0:
            assert draft.tokens == heads_cpu.confident_prefix(tokens[b], confidence[b], 0.2)[: [4, 4, 3, 2, 4][b]]
            assert draft.probs is None
        else:
            assert len(draft.tokens) == [4, 4, 3, 2, 4][b] and draft.probs.shape == (len(draft.tokens), CFG.vocab_size)
    gated = HeadsDrafter(heads, model)
    assert gated.min_confidence == heads_cpu.MIN_CONFIDENCE and gated.gated_k == heads_cpu.GATED_K
    assert drafter.gated_k is None and HeadsDrafter(heads, model, cpu_blocks=False).gated_k is None


def test_an_mxfp4_target_packs_its_heads_with_the_block_kernels_settings():
    """An MXFP4 output head (the CPU's block kernels read it: a verification row costs as on GGUF blocks) gets the
    GGUF target's gate; its draft-vocabulary rows are its dequantized rows quantized to Q8_0."""
    from specchat.quant.fp4_linear import Fp4Linear, TiedEmbedding

    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    model.lm_head = Fp4Linear.from_linear(model.lm_head)
    heads = random_heads(model)
    drafter = HeadsDrafter(heads, model)
    assert heads_cpu.drafting(model) == heads_cpu.drafting(packed_target())
    assert drafter.c_chain is not None and drafter.min_confidence == heads_cpu.MIN_CONFIDENCE
    rows = model.lm_head.dequantized(torch.float32)[heads.draft_vocab[: heads_cpu.DRAFT_ROWS]]
    assert torch.equal(drafter.output.rows.codes, quantize_q8_0(rows)[0])
    hidden, prev = torch.randn(3, CFG.hidden_size) * 2, torch.randint(0, CFG.vocab_size, (3,))
    with torch.inference_mode():
        assert torch.equal(c_chain(drafter, 3, hidden, prev), drafter.greedy_chain(3, hidden, prev))
    # the embedding tied to the MXFP4 head, as `--weights mxfp4` holds the default model: no table to read, so the
    # chain reads a bf16 copy of it (its drafts' inputs rounded: drafts, not outputs, may differ from the modules')
    model.embed = TiedEmbedding(model.lm_head, torch.float32)
    tied = HeadsDrafter(heads, model)
    assert tied.c_chain is not None and tied.c_chain.tensors[3].dtype == torch.bfloat16
    with torch.inference_mode():
        drafts = c_chain(tied, 3, hidden, prev)
    assert set(drafts.flatten().tolist()) <= set(tied.draft_vocab.tolist())
