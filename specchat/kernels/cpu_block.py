"""One decoder block of a CPU decode step in one C call: the kernels of cpu_gemv.py, cpu_ops.py and
cpu_attention.py chained in C.

Per layer the fused path of engine/cpu_fusion.py would make ~9 calls from Python (norm, four block-quantized
linears, RoPE, attention, add + norm, SiLU-mul) with their wrappers and module calls around them: ~90 us of
Python per layer, ~2.8 ms of a ~20 ms token (docs/benchmarks.md, issue 20). `decode_block` runs the same
calls, in the same order, on the same C functions (this library is built from their sources plus the chain
in csrc/cpu_block.c), so its output equals the per-op path bit for bit, which tests/kernels/test_cpu_block.py holds:

    h = rms_norm(x);  q, k, v = split(wqkv(h) [+ bias]);  q, k = rope(q, k)
    a = wo(paged_attention(q, k, v))  (k, v stored in the pages first)
    s, h = add_rms_norm(x, a);  out = s + down(silu_mul(gate_up(h)))

`BlockWeights` takes the pointers of one block's weights once (as cpu_gemv.Bound does for one linear): each of
the four linears as GGUF Q4_1 or Q8_0 blocks (float activations, cpu_gemv.py, or int8 activations, cpu_gemv_i8.py)
or MXFP4 codes (float activations, cpu_gemv.fp4_gemm, or int8 ones, cpu_gemv_i8's fp4i8_gemm; the x blocks rotated
there for a RotatedFp4Linear), the two norm weights, and the optional q/k/v bias.

`draft_chain` does the same for the draft heads' greedy chain (engine/drafters/heads.py, packed by heads_cpu.py):
per draft position two norms, the head's up and down linears around a SiLU, the final norm, the draft-vocabulary
rows of the lm_head and their argmax, the modules' calls in their order (the same drafts: tests/engine/
test_heads_cpu.py). A k = 1 draft took ~0.37 ms of a ~4.4 ms step through the modules, ~0.14 ms in one call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch

from specchat.kernels import cpu_attention, cpu_build, cpu_gemv, cpu_gemv_i8, cpu_ops

# The chain's C (csrc/cpu_block.c), built after every kernel module's (`_sources`).
C_SOURCE = cpu_build.c_source("cpu_block.c")


class Weight(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("int8_act", ctypes.c_int),
        ("fp4", ctypes.c_int),
    ]


class Block(ctypes.Structure):
    _fields_ = [
        *((name, Weight) for name in ("wqkv", "wo", "gate_up", "down")),
        *((name, ctypes.c_void_p) for name in ("qkv_bias", "attn_norm", "mlp_norm")),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_int) for name in ("hidden", "q_size", "kv_size", "inter")),
    ]


class Head(ctypes.Structure):
    _fields_ = [("up", Weight), ("down", Weight), ("state_norm", ctypes.c_void_p), ("embed_norm", ctypes.c_void_p)]


class Heads(ctypes.Structure):
    _fields_ = [
        ("heads", ctypes.POINTER(Head)),
        ("rows", Weight),
        *((name, ctypes.c_void_p) for name in ("out_norm", "embed", "vocab")),
        ("eps", ctypes.c_float),
        ("out_eps", ctypes.c_float),
        ("hidden", ctypes.c_int),
        ("ffn", ctypes.c_int),
        ("embed_rows", ctypes.c_long),
        ("embed_bf16", ctypes.c_int),
    ]


def _sources() -> tuple[str, str]:
    """Every CPU kernel module's C source and this one's: one library serves them all (cpu_build.load_part). Built
    as two translation units compiled side by side: the attention's kernels (each KV format's functions, half the
    compiler's time) and the rest, which declares them."""
    everything = cpu_gemv.C_SOURCE + cpu_gemv_i8.C_SOURCE + cpu_ops.C_SOURCE + cpu_attention.C_SOURCE + C_SOURCE
    kernels = cpu_ops.C_HEADER + cpu_attention.C_KERNELS
    return "#define KV_INSTANCES_DECLARE 1\n" + everything, "#define KV_INSTANCES_DEFINE 1\n" + kernels


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("cpu_block", _sources(), cpu_ops.CFLAGS)
    if lib is None:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.decode_block.argtypes = [ctypes.POINTER(Block), ctypes.POINTER(cpu_attention.Plan), i32, ptr, ptr, ptr]
    lib.decode_block.argtypes += [ptr, ptr, ptr, ptr, ctypes.POINTER(cpu_attention.Rotation), ptr, i32]
    lib.decode_block.restype = ctypes.c_int
    lib.decode_layers.argtypes = [ptr, i32, ctypes.POINTER(cpu_attention.Plan), i32, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.decode_layers.argtypes += [i32]
    lib.decode_layers.restype = ctypes.c_int
    lib.draft_chain.argtypes = [ctypes.POINTER(Heads), i32, i32, ptr, ptr, ptr, ptr, ctypes.c_float, i32]
    lib.draft_chain.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled block loads on this machine."""
    return _library() is not None


def combined(cflags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library of every CPU kernel where these are its flags and it builds, else None."""
    return _library() if cflags == tuple(cpu_ops.CFLAGS) else None


def built() -> bool:
    """Whether nothing is left to build: the library cached on disk, or loaded (or its build tried and failed) in
    this process. A first build takes ~15-19 s on 2 cores."""
    return (
        _library.cache_info().currsize > 0 or cpu_build.library_path("cpu_block", _sources(), cpu_ops.CFLAGS).exists()
    )


BoundWeight = cpu_gemv.Bound | cpu_gemv_i8.Bound | cpu_gemv_i8.Fp4Bound  # float or int8 activations


def _weight(bound: BoundWeight) -> Weight:
    codes, d, *m = bound.tensors
    int8_act = isinstance(bound, cpu_gemv_i8.Bound | cpu_gemv_i8.Fp4Bound)
    assert bound.kind in ("q4_1", "q8_0", "mxfp4"), bound.kind
    fp4 = 1 + bound.rotate if bound.kind == "mxfp4" else 0
    return Weight(codes.data_ptr(), d.data_ptr(), m[0].data_ptr() if m else None, bound.n, bound.k, int8_act, fp4)


class BlockWeights:
    """One block's weights as decode_block reads them: the four linears as checked cpu_gemv / cpu_gemv_i8 Bound
    weights, the norms' weights [hidden] and eps, the q/k/v bias or None. Holds the tensors, so the pointers stay
    valid."""

    def __init__(
        self,
        wqkv: BoundWeight,
        wo: BoundWeight,
        gate_up: BoundWeight,
        down: BoundWeight,
        attn_norm: torch.Tensor,
        mlp_norm: torch.Tensor,
        eps: float,
        q_size: int,
        kv_size: int,
        qkv_bias: torch.Tensor | None = None,
    ) -> None:
        hidden, inter = wqkv.k, down.k
        assert wqkv.n == q_size + 2 * kv_size and wo.k == q_size and wo.n == hidden, (wqkv.n, wo.k, wo.n)
        assert gate_up.k == hidden and gate_up.n == 2 * inter and down.n == hidden, (gate_up.n, down.n)
        for t, n in ((attn_norm, hidden), (mlp_norm, hidden), *(((qkv_bias, wqkv.n),) if qkv_bias is not None else ())):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n,) and t.is_cpu, (t.dtype, t.shape)
        self.tensors = (wqkv, wo, gate_up, down, attn_norm, mlp_norm, qkv_bias)
        self.hidden = hidden
        self.struct = Block(
            _weight(wqkv), _weight(wo), _weight(gate_up), _weight(down),
            None if qkv_bias is None else qkv_bias.data_ptr(), attn_norm.data_ptr(), mlp_norm.data_ptr(),
            eps, hidden, q_size, kv_size, inter,
        )  # fmt: skip
        self.ref = ctypes.byref(self.struct)


def decode_block(
    weights: BlockWeights,
    plan: cpu_attention.AttentionPlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: cpu_attention.Pages,
    v_pages: cpu_attention.Pages,
    threads: int,
    rotation: cpu_attention.PageRotation | None = None,
) -> torch.Tensor:
    """x [T, hidden] float32 -> the block's output [T, hidden]; this step's keys/values written into the pages at
    the plan's slots: dense pages [KVH, slots, D] of the plan's kv_dtype (float32, float16 or bfloat16), or
    quantized ones (kv_quant.PageTensor) with their rotation, as cpu_attention stores them."""
    t = plan.tokens
    assert x.shape == (t, weights.hidden) and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu, x.shape
    for rot in (cos, sin):
        assert rot.shape == (t, plan.head_dim) and rot.dtype == torch.float32 and rot.is_contiguous(), rot.shape
    pages = cpu_attention.page_pointers(plan, k_pages, v_pages, rotation)
    out = torch.empty(t, weights.hidden)
    status = _library().decode_block(
        weights.ref, plan.ref, t, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), *pages, out.data_ptr(), threads
    )
    if status != 0:
        raise MemoryError("cpu_block.decode_block: no memory for the block's scratch rows")
    return out


def plan_formats(plan: cpu_attention.AttentionPlan) -> tuple:
    """What BoundLayers checks its pages against: a step's plan must read them in the same formats."""
    return plan.kv_dtype, plan.quantized, plan.pages_shape, plan.num_heads, plan.head_dim


class BoundLayers:
    """A model's blocks as decode_layers reads them, bound once: each block's weights (BlockWeights) and KV pages
    (key pages, value pages, rotation: dense pages, or quantized ones and their rotation, as decode_block takes
    them), checked against the formats of `plan` (any step's plan of the same page store). Holds the weights; the
    pages stay their store's (the caller binds again once the store or the weights change: engine/cpu_fusion.py),
    so a store emptied for a new KV format is not kept alive by it."""

    def __init__(
        self,
        weights: list[BlockWeights],
        pages: list[tuple[cpu_attention.Pages, cpu_attention.Pages, cpu_attention.PageRotation | None]],
        plan: cpu_attention.AttentionPlan,
    ) -> None:
        layers = len(weights)
        assert layers == len(pages) > 0 and all(w.hidden == weights[0].hidden for w in weights)
        pointers = []
        for k, v, rotation in pages:  # (the rotation by address: page_pointers gives it byref, for a call's argument)
            pointers += [
                *cpu_attention.page_pointers(plan, k, v, rotation)[:4],
                rotation and ctypes.addressof(rotation.struct),
            ]
        self.kept = weights
        self.layers, self.hidden = layers, weights[0].hidden
        self.formats = plan_formats(plan)
        self.weights = (ctypes.c_void_p * layers)(*(ctypes.addressof(w.struct) for w in weights))
        self.pages = (ctypes.c_void_p * (5 * layers))(*pointers)


def decode_layers(
    bound: BoundLayers,
    plan: cpu_attention.AttentionPlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    taps: Sequence[int],
    threads: int,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """`decode_block` for each bound block in turn in one C call: x [T, hidden] -> (the last block's output, {layer:
    its output} for the layers in `taps`). The same calls in the same order as block by block, so the same bits
    (tests/engine/test_cpu_fusion.py)."""
    t, layers, hidden = plan.tokens, bound.layers, bound.hidden
    assert plan_formats(plan) == bound.formats, (plan_formats(plan), bound.formats)
    assert x.shape == (t, hidden) and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu, x.shape
    for rot in (cos, sin):
        assert rot.shape == (t, plan.head_dim) and rot.dtype == torch.float32 and rot.is_contiguous(), rot.shape
    tapped = {layer: torch.empty(t, hidden) for layer in taps if 0 <= layer < layers}
    tap_ptrs = (ctypes.c_void_p * layers)()
    for layer, out in tapped.items():
        tap_ptrs[layer] = out.data_ptr()
    out = torch.empty(t, hidden)
    status = _library().decode_layers(
        bound.weights, layers, plan.ref, t, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), bound.pages, tap_ptrs,
        out.data_ptr(), threads,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("cpu_block.decode_layers: no memory for the blocks' scratch rows")
    return out, tapped


EMBED_DTYPES = (torch.float32, torch.bfloat16)  # the embeddings draft_chain reads


class HeadsWeights:
    """Sequential draft heads as draft_chain reads them: per head its up [ffn, 2 hidden] and down [hidden, ffn] as
    Bound weights and its two norms' weights; the draft-vocabulary rows of the lm_head (Bound), the target's final
    norm, its embedding [vocab, hidden] (float32, or bfloat16: a bfloat16 target's, widened a row at a time) and
    the draft vocabulary (row -> token id, int64). Holds the tensors, so the pointers stay valid."""

    def __init__(
        self,
        heads: Sequence[tuple[BoundWeight, BoundWeight, torch.Tensor, torch.Tensor]],
        eps: float,
        rows: BoundWeight,
        out_norm: torch.Tensor,
        out_eps: float,
        embed: torch.Tensor,
        vocab: torch.Tensor,
    ) -> None:
        hidden, ffn = rows.k, heads[0][0].n
        for up, down, state_norm, embed_norm in heads:
            assert (up.n, up.k, down.n, down.k) == (ffn, 2 * hidden, hidden, ffn), (up.n, up.k, down.n, down.k)
            for t in (state_norm, embed_norm):
                assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (hidden,) and t.is_cpu, t.shape
        assert out_norm.dtype == torch.float32 and out_norm.is_contiguous() and out_norm.shape == (hidden,)
        assert embed.dtype in EMBED_DTYPES and embed.is_contiguous() and embed.dim() == 2 and embed.shape[1] == hidden
        assert vocab.dtype == torch.int64 and vocab.is_contiguous() and vocab.shape == (rows.n,), vocab.shape
        self.tensors = (heads, rows, out_norm, embed, vocab)
        self.num_heads, self.hidden = len(heads), hidden
        self.heads = (Head * len(heads))(
            *(Head(_weight(up), _weight(down), sn.data_ptr(), en.data_ptr()) for up, down, sn, en in heads)
        )
        self.struct = Heads(
            self.heads, _weight(rows), out_norm.data_ptr(), embed.data_ptr(), vocab.data_ptr(), eps, out_eps,
            hidden, ffn, embed.shape[0], embed.dtype == torch.bfloat16,
        )  # fmt: skip
        self.ref = ctypes.byref(self.struct)


def draft_chain(
    weights: HeadsWeights,
    depth: int,
    hidden: Sequence[torch.Tensor],
    prev: Sequence[int],
    threads: int,
    floor: float = 0.0,
) -> tuple[list[list[int]], list[list[float]]]:
    """The heads' greedy drafts [B][n] (token ids) from each request's h_t (hidden[i]: [hidden] float32, its last
    dim contiguous, e.g. a row of its tapped states) and newest token prev[i], in one C call: the same calls in the
    same order as the packed HeadsDrafter's modules, so the same drafts (tests/engine/test_heads_cpu.py). Also each
    draft's probability under its head's softmax over the draft vocabulary [B][n] (NaN where the logits were).
    n = depth, or fewer where every request's chain probability fell below `floor` before (the positions after
    are not drafted). Lists in and out: a decode step's drafting takes ~40 us of Python around ~35-100 us of C."""
    b = len(hidden)
    assert 1 <= depth <= weights.num_heads and len(prev) == b > 0, (depth, weights.num_heads, len(prev), b)
    for row in hidden:
        assert row.shape == (weights.hidden,) and row.dtype == torch.float32 and row.stride(0) == 1, row.shape
        assert not row.is_cuda
    out, conf = (ctypes.c_int64 * (b * depth))(), (ctypes.c_float * (b * depth))()
    drafted = _library().draft_chain(
        weights.ref, b, depth, (ctypes.c_void_p * b)(*(row.data_ptr() for row in hidden)),
        (ctypes.c_int64 * b)(*prev), out, conf, floor, threads,
    )  # fmt: skip
    if drafted == -2:
        raise ValueError(f"cpu_block.draft_chain: a token id of {list(prev)} is outside the embedding")
    if drafted < 0:
        raise MemoryError("cpu_block.draft_chain: no memory for the heads' rows")
    rows = range(0, b * depth, depth)
    return [out[i : i + drafted] for i in rows], [conf[i : i + drafted] for i in rows]
