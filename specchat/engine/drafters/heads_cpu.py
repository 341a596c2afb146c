"""The draft heads on the CPU read as int8 blocks: a transform of a HeadsDrafter (docs/style.md #6).

At batch 1 the heads' drafting is bound by the bytes it reads: per draft position one head block (up [f, 2d] and
down [d, f]) and the draft-vocabulary rows of the lm_head ([Vd, d]), in float32 4 bytes a weight, ~23 MB a
position for the default model (~91 MB a k = 4 step: 4.7 ms a chain repeated alone, ~8 ms inside decoding,
where the target's forward runs between chains and leaves less of it in the cache).
`pack_for_cpu(drafter, model)` gives the drafter, where the target reads its own weights as GGUF blocks
(engine/cpu_weights.pack_blocks: a float32 model on the CPU, not --eager), the same work on Q8_0 blocks, 1.06
bytes a weight (1.125 as the kernels hold them: a float32 scale per 32 codes; ~26 MB a k = 4 step), through the
block kernels the target uses:

- the draft-vocabulary output takes the lm_head's own GGUF blocks, the rows of `draft_vocab` sliced once: the
  same weights as the float slice (the float lm_head is their dequantization);
- each head's linears are quantized to Q8_0 by gguf's quantizer (`cpu_weights.quantize_q8_0`): d = max|w| / 127
  per block of 32, stored as float16, q = round(w / d). This rounds the trained weights (bf16 in the file);
- both multiply with int8 activation rows (kernels/cpu_gemv_i8.py) where the CPU has AVX512-VNNI, whatever
  `--cpu-act` says for the target, else with float rows (kernels/cpu_gemv.py);
- the heads' RMSNorms run as the C kernel (engine/cpu_fusion.CpuRMSNorm), their SiLU as cpu_ops.silu;
- greedy chains run as one C call (kernels/cpu_block.draft_chain, bound once by `chain_weights`): the modules'
  calls in their order, without the Python between them (~0.37 -> ~0.14 ms a k = 1 draft inside decoding).

They also draft from the first DRAFT_ROWS entries of the draft vocabulary (its most frequent tokens) instead of
all 8,192 of the shipped heads: the output rows are ~85% of a position's bytes, and the 4,096 most frequent cover
99.0% of the train split's greedy answer tokens against 99.8% (tokens per step over the eval prompts 1.63 against
1.64 at k = 2, 1.72 against 1.73 at k = 4; heads 1.29x -> 1.33x and ngram+heads 1.66x -> 1.71x plain decoding
under int8 rows: docs/benchmarks.md, "Fewer draft-vocabulary rows on the CPU"); since the chain runs in C behind the
confidence gate, the 2,048 most frequent.

A target on torch's float linears (bfloat16 on a CPU with native bf16, which `--dtype auto` picks there for a
model without GGUF blocks; a float32 model without them) has no blocks to share: its draft-vocabulary rows are
quantized to Q8_0 here, its final norm copied to float32, and the C chain widens its bfloat16 embedding a row at
a time. The heads then draft in float32 at ~0.1 ms a position against a 25-40 ms bf16 step (the float heads in
bf16 took ~5 ms a k = 4 chain). A verification row costs a few % of such a step, not ~12%, so `drafting` gives
them a lower floor and all five heads (an MXFP4 target, whose linears the block kernels read, keeps the GGUF
target's settings).

So the packed heads may propose other tokens than the float heads where two draft logits nearly tie. That costs
no exactness: the target verifies every draft (docs/speculative.md). The float heads (`--eager`, or
`HeadsDrafter(..., cpu_blocks=False)`) are the reference; tests/engine/test_heads_cpu.py holds the packed ones to
their own plain reference (the dequantized weights, int8 rows as cpu_gemv_i8's references round them).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from specchat.engine import cpu_fusion
from specchat.engine.cpu_weights import (
    BlockEmbedding,
    BlockLinear,
    as_block_linear,
    quantize_q8_0,
    set_activations,
)
from specchat.kernels import cpu_block, cpu_gemv, cpu_gemv_i8, cpu_ops
from specchat.quant.fp4_linear import Fp4Linear, TiedEmbedding

if TYPE_CHECKING:
    from specchat.engine.drafters.heads import DraftHeads, HeadsDrafter
    from specchat.engine.model import Transformer

# draft-vocabulary entries the packed heads draft from (the most frequent first): 4,096 until the chain ran in C
# behind the confidence gate, where 2,048 drafted as many tokens per step (1.68 against 1.69) and ran 1-2% faster
# (docs/benchmarks.md, "Sixteenth session")
DRAFT_ROWS = 2048
# where ngram+heads' n-grams miss, the packed heads draft at most this many (2: ngram+heads 1.57x -> 1.65x plain
# decoding at k = 4 under int8 rows: docs/benchmarks.md, "The n-grams and the heads each at their own k"; 3 since
# their chain is gated by confidence and stops early: auto 1.59x / 1.55x -> 1.62x / 1.57x, "Sixteenth session")
HYBRID_HEADS_K = 3
# a greedy chain stops before the first draft whose chain probability (the product of its heads' softmax
# probabilities over the draft vocabulary) is below this: such a draft is accepted about as often as that
# probability says (CPU, eval prompts), too rarely to pay for its verification row (~12% of a step here). 0.2 until
# 2026-12-07: on the AVX512-VNNI Xeon, whose int8 rows make a plain step faster and a row dearer beside it, 0.3 ran
# the heads 1.29x -> 1.36x plain decoding over 30 eval prompts (ngram+heads 1.50x -> 1.51x; four runs, each +3-7%
# for the heads: docs/benchmarks.md, fifty-third session)
MIN_CONFIDENCE = 0.3
GATED_K = 3  # what such heads draft up to under adaptive K: their gate, not the controller, picks the length
# The same on a float target (a bf16 model on a CPU with native bf16), where a verification row costs a few % of a
# step (the default model in bf16: 1 + 4 rows 43.9 ms against 42.0 for one through torch's linears, 1 + 5 rows 30.5
# against 25.5 through cpu_weights.Bf16Linear) and a draft position ~0.1 ms: a lower floor and all five heads
# (chosen under torch's linears, 1.82x plain decoding since: docs/benchmarks.md, "Forty-first session"). All 8,192
# draft-vocabulary rows drafted 0.05 tokens per step more and ran 3% slower there, each position reading 4x the rows.
FLOAT_MIN_CONFIDENCE = 0.05
FLOAT_GATED_K = 5
FLOAT_HYBRID_HEADS_K = 5


class Drafting(NamedTuple):
    """How packed heads draft on a target: confidence floor, gated k, and the most they draft in ngram+heads where
    the n-grams miss (they draft from DRAFT_ROWS rows on every target)."""

    min_confidence: float
    gated_k: int
    hybrid_k: int


def drafting(model: Transformer) -> Drafting:
    """The packed heads' settings for this target: weights the CPU's block kernels read (GGUF blocks, or MXFP4
    codes), where a verification row costs ~12% of a step, or a bf16 model's linears, where it costs a few %."""
    if isinstance(model.lm_head, BlockLinear | Fp4Linear):
        return Drafting(MIN_CONFIDENCE, GATED_K, HYBRID_HEADS_K)
    return Drafting(FLOAT_MIN_CONFIDENCE, FLOAT_GATED_K, FLOAT_HYBRID_HEADS_K)


def block_linear(weight: torch.Tensor, blocks: tuple[torch.Tensor, ...], kind: str) -> BlockLinear:
    """A bias-free linear over GGUF `blocks` (codes, d[, m]) whose float weight is `weight` (rows above
    cpu_gemv.MAX_ROWS use it), multiplying with int8 rows where the CPU has AVX512-VNNI or AVX2."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    as_block_linear(linear, kind, tuple(b.contiguous() for b in blocks))
    set_activations(linear, "int8" if cpu_gemv_i8.available() else "fp32")  # bound now, not in the first draft step
    return linear


def q8_0_linear(weight: torch.Tensor) -> BlockLinear:
    """A bias-free linear over `weight` [N, K] quantized to Q8_0 blocks as gguf does (its float weight: the blocks
    dequantized, so every row count computes with the same weights)."""
    codes, d = quantize_q8_0(weight)
    return block_linear(cpu_gemv.q8_dequantize(codes, d), (codes, d), "q8_0")


def pack_heads(heads: DraftHeads) -> DraftHeads:
    """A float32 copy of `heads` whose linears read Q8_0 blocks of their weights and whose norms are the C
    kernel."""
    packed = copy.deepcopy(heads).float()
    for block in packed.blocks:
        for name in ("up", "down"):
            setattr(block, name, q8_0_linear(getattr(block, name).weight))
        if cpu_ops.available():
            block.act = cpu_ops.silu  # what the C draft chain computes
    cpu_fusion.fuse(packed)
    return packed


def draft_vocab_rows(model: Transformer, draft_vocab: torch.Tensor, weight: torch.Tensor) -> BlockLinear:
    """The lm_head's GGUF block rows of `draft_vocab` as a linear (its float weight: `weight`, those rows
    dequantized): state [B, d] -> logits [B, Vd]."""
    head = model.lm_head
    assert isinstance(head, BlockLinear), "the target's lm_head does not read GGUF blocks"
    blocks = tuple(head._buffers[name][draft_vocab] for name in ("codes", "d", "m") if name in head._buffers)
    return block_linear(weight, blocks, head.kind)


def packable(model: Transformer) -> bool:
    """Whether the heads read Q8_0 blocks on the CPU: the target reads its lm_head as GGUF blocks (pack_blocks made
    it, so the kernels load here), or it runs torch's float linears on the CPU where the block kernels load."""
    head = model.lm_head
    if isinstance(head, BlockLinear):
        return True
    if isinstance(head, Fp4Linear):  # (its .weight would dequantize the whole head)
        return not head.codes.is_cuda and cpu_gemv.available()
    weight = getattr(head, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.is_cpu and cpu_gemv.available()


def pack_for_cpu(drafter: HeadsDrafter, model: Transformer) -> None:
    """Swap the drafter's heads and its draft-vocabulary rows for their block forms (see the module docstring),
    and bind them for the chain in C where it loads. A float target's (torch's linears, bfloat16 on a CPU with
    native bf16 included) draft-vocabulary rows are quantized to Q8_0 here, and the heads draft in float32 with
    a float32 copy of its final norm."""
    drafter.heads = pack_heads(drafter.heads)
    output = drafter.output
    if isinstance(model.lm_head, BlockLinear):
        output.rows = draft_vocab_rows(model, drafter.draft_vocab, output.rows.weight)
    else:
        output.rows = q8_0_linear(output.rows.weight.float())
        output.norm = copy.deepcopy(model.norm).float()
        cpu_fusion.fuse(output.norm)
    drafter.c_chain = chain_weights(drafter, model)
    linears = [output.rows, *(linear for b in drafter.heads.blocks for linear in (b.up, b.down))]
    drafter.c_chain_gemms = [linear for linear in linears if linear.gemm_for_many_rows]  # (float rows)


def chain_weights(drafter: HeadsDrafter, model: Transformer) -> cpu_block.HeadsWeights | None:
    """The packed sequential heads, the draft-vocabulary rows, the final norm and the target's embedding (float32
    or bfloat16) bound for cpu_block.draft_chain; None where it cannot run them (no compiled block library,
    parallel heads, norms or an embedding of another kind)."""
    heads, norm, embed = drafter.heads, drafter.output.norm, model.embed
    if not (cpu_block.available() and cpu_ops.available() and heads.cfg.sequential):
        return None
    # an embedding tied to a quantized head (quant/fp4_linear.TiedEmbedding) has no table: the chain reads a copy,
    # of an MXFP4 head's rows in bf16 (half the bytes of float32; the drafts' inputs only, verification reads the
    # target's own), of GGUF blocks (the head's, or its own: BlockEmbedding) in float32 (the table's values, as when
    # the embedding held it)
    if isinstance(embed, TiedEmbedding):
        gguf = isinstance(embed.head, (BlockLinear, BlockEmbedding))
        embed = embed.weight if gguf else embed.weight.to(torch.bfloat16)
    else:
        embed = getattr(embed, "weight", None)
    if not isinstance(embed, torch.Tensor) or embed.dtype not in cpu_block.EMBED_DTYPES or not embed.is_contiguous():
        return None
    norms = [n for b in heads.blocks for n in (b.state_norm, b.embed_norm)]
    if not all(isinstance(n, cpu_fusion.CpuRMSNorm) for n in (*norms, norm)) or len({n.eps for n in norms}) != 1:
        return None  # (the modules' norms would round otherwise)
    blocks = [(b.up.bound(), b.down.bound(), b.state_norm.weight, b.embed_norm.weight) for b in heads.blocks]
    return cpu_block.HeadsWeights(
        blocks, norms[0].eps, drafter.output.rows.bound(), norm.weight.detach(), norm.eps, embed.detach(),
        drafter.draft_vocab.contiguous(),
    )  # fmt: skip


def draft_chain(
    drafter: HeadsDrafter, depth: int, hidden: list[torch.Tensor], prev: list[int], floor: float | None = None
) -> tuple[list[list[int]], list[list[float]]] | None:
    """The packed heads' greedy chain in one C call: each request's h_t (hidden[i], [d]) and newest token ->
    (its drafts [B][n], each draft's probability under its head [B][n]; n < depth where every request's chain
    fell below `floor` (default: the drafter's min_confidence) before: cpu_block.draft_chain); None where the
    modules must run it (no C chain bound, rows on another device, float rows of a count that takes the float
    GEMM: BlockLinear.takes_gemm). A bfloat16 target's rows are widened to float32."""
    weights = drafter.c_chain
    if weights is None or hidden[0].is_cuda:
        return None
    if any(linear.takes_gemm(len(hidden)) for linear in drafter.c_chain_gemms):
        return None
    floor = drafter.min_confidence if floor is None else floor
    rows = [row.float() for row in hidden]
    return cpu_block.draft_chain(weights, depth, rows, prev, torch.get_num_threads(), floor)


def confident_prefix(tokens: list[int], confidence: list[float], floor: float) -> list[int]:
    """The drafts up to the last whose chain probability (the product of the heads' probabilities so far) is at
    least `floor`: a draft the target is unlikely to reach and accept costs a verification row for little."""
    reach, n = 1.0, 0
    for p in confidence:
        reach *= p
        if not reach >= floor:  # (NaN stops the chain too)
            break
        n += 1
    return tokens[:n]
