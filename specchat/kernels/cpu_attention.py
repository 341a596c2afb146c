"""Attention of a CPU decode or verification step over the paged KV cache, in C, beside its torch reference.

`paged_attention` stores this step's keys/values at their slots of dense pages [KVH, slots, D], then computes each
new token's causal attention over its request's context, read through the block table where it lies (no gather into
a contiguous copy, no division per key: a page's rows are walked in order); the query heads of a KV group read their
KV head's rows. Pages hold float32, float16 or bfloat16 elements (`AttentionPlan.kv_dtype`): this step's rows are
rounded into them as torch converts, and every element read is widened to float32 exactly (vcvtph2ps, a 16-bit
shift), so the arithmetic (csrc/cpu_attention_kernels.c) is the same for each type; half-width pages halve the bytes
a long context reads per token, which at a few thousand tokens is most of a decode step's traffic. Per query row:
scores q.k * scale (a D/16-vector dot product, reduced once), softmax as exp(s - max) * (1 / sum) with
kernels/cpu_ops.py's exp and fixed-order sum, then sum_j p_j v_j. Every row alone and the same way whatever the
batch, so a verification step gives each token the scores plain decoding gives it. `AttentionPlan` is the step's
metadata, built once a step (engine/kv_batch.py) and read by every layer. `paged_attention_ref` is the plain torch
version tests/kernels/test_cpu_ops.py holds it to (and kernels/attention.paged_attention_reference, the reference of
every page format).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from specchat.kernels import cpu_build, cpu_ops, kv_quant, mxfp4

MAX_HEAD_DIM = 256  # the kernel keeps a query row's output in registers (16 floats per vector)
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # dense page element types the kernel reads
QUANTIZED_TYPES = {"mxfp8": 3, "mxfp4": 4}  # quantized ones (kernels/kv_quant.py element formats)
QUANTIZED_PAIRS = (("mxfp8", "mxfp4"), ("mxfp4", "mxfp4"))  # (keys, values) the kernel is built for: k8v4, mxfp4

# The C of this kernel (csrc/), built over cpu_ops' (C_SOURCE there): cpu_attention_kernels.c, each KV format's
# functions and what they inline (C_KERNELS: kernels/cpu_block.py compiles them as a translation unit of their own
# beside the rest of the library), then cpu_attention.c: the quantize-on-append and paged_attention, bound below.
C_KERNELS = cpu_build.c_source("cpu_attention_kernels.c")
C_SOURCE = C_KERNELS + cpu_build.c_source("cpu_attention.c")


class Plan(ctypes.Structure):
    """The C kernel's view of one step (the `Plan` struct of C_SOURCE)."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("batch", "heads", "kv_heads", "head_dim", "page_size")),
        ("table_width", ctypes.c_int),
        ("tokens", ctypes.c_int),
        ("k_type", ctypes.c_int),
        ("v_type", ctypes.c_int),
        ("num_slots", ctypes.c_long),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tables", "q_starts", "q_lens", "ctx_lens", "slots")),
    ]


class Rotation(ctypes.Structure):
    """How quantized pages hold a layer's rows (the `Rotation` struct of C_SOURCE): see `PageRotation`."""

    _fields_ = [
        ("q_mat", ctypes.c_void_p),
        ("q_head", ctypes.c_long),
        ("k_mat", ctypes.c_void_p),
        ("k_head", ctypes.c_long),
        ("hadamard", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("rule", ctypes.c_int),
    ]


class PageRotation:
    """How quantized pages hold a layer's rows (engine/kv_pages.py's rotation and key transform), and the MXFP4
    scale rule: `hadamard` = R's block (the block-diagonal Sylvester-Hadamard matrix kv_pages.rotation_matrix
    makes, entries +-`scale`; 0: no rotation). Values are stored as v R, keys as k @ k_mat where a key transform
    gives one (A R), else k R; queries attend as q @ q_mat, else q R; the output is rotated by R on the way out.
    q_mat and k_mat: [KVH, D, D] (a query head takes its KV head's) or [D, D] or None. R is applied by
    butterflies (`hadamard_rows_ref`), the matrices as ordered sums (`rotate_rows_ref`). Built once a layer
    (kv_pages.PageStore.cpu_rotation)."""

    def __init__(
        self, q_mat: torch.Tensor | None, k_mat: torch.Tensor | None, hadamard: int, scale: float, rule: str
    ) -> None:
        self.mats = tuple(None if m is None else m.float().contiguous() for m in (q_mat, k_mat))
        self.hadamard, self.scale, self.rule = hadamard, scale, rule
        head = [0 if m is None or m.dim() == 2 else m.shape[-1] ** 2 for m in self.mats]
        ptrs = [None if m is None else m.data_ptr() for m in self.mats]
        rule_id = mxfp4.RULES.index(rule)
        self.struct = Rotation(ptrs[0], head[0], ptrs[1], head[1], hadamard, scale, rule_id)
        self.ref = ctypes.byref(self.struct)

    def rows_ref(self, x: torch.Tensor, mat: torch.Tensor | None) -> torch.Tensor:
        """x [..., D] into the pages' basis as the kernel computes it: mat where given, else R."""
        return rotate_rows_ref(x, mat) if mat is not None else hadamard_rows_ref(x, self.hadamard, self.scale)


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load_part("cpu_attention", cpu_ops.C_SOURCE + C_SOURCE, cpu_ops.CFLAGS)
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_long
    lib.paged_attention.argtypes = [ctypes.POINTER(Plan), ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.paged_attention.argtypes += [ctypes.POINTER(Rotation), ptr, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    i32 = ctypes.c_int
    lib.quantize_rows.argtypes = [i32, i32, i32, i32, ptr, i64, ptr, i32, ctypes.c_float, ptr, ptr]
    lib.quantize_rows.restype = None
    return lib


def available() -> bool:
    """Whether the compiled kernel loads on this machine."""
    return _library() is not None


def supports(head_dim: int) -> bool:
    """Whether the kernel attends at this head_dim here (compiled, and a query row's output fits its registers)."""
    return head_dim <= MAX_HEAD_DIM and available()


class AttentionPlan:
    """One step's requests as the attention kernel reads them, built once per step and used by every layer:
    block tables [B, pages] int32, each request's first query row, new tokens and context length [B] int32,
    and the slots [T] int64 where the step's keys and values go."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        slots: torch.Tensor,
        page_size: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        num_slots: int,
        scale: float,
        kv_dtype: torch.dtype = torch.float32,
        quantized: tuple[str, str] | None = None,
    ) -> None:
        """kv_dtype: the dense pages' element type; quantized: the element formats of the keys' and the values'
        pages where they are quantized instead ("mxfp8" or "mxfp4" each: kv_quant.PageTensor), read by
        `paged_attention_quantized`."""
        assert block_tables.dtype == q_starts.dtype == q_lens.dtype == ctx_lens.dtype == torch.int32
        assert slots.dtype == torch.int64 and slots.dim() == 1, (slots.dtype, slots.shape)
        assert num_heads % kv_heads == 0 and head_dim <= MAX_HEAD_DIM, (num_heads, kv_heads, head_dim)
        assert quantized is None or quantized in QUANTIZED_PAIRS, quantized
        self.tensors = tuple(t.contiguous() for t in (block_tables, q_starts, q_lens, ctx_lens, slots))
        batch = q_lens.shape[0]
        assert block_tables.shape[0] == q_starts.shape[0] == ctx_lens.shape[0] == batch, block_tables.shape
        assert bool((q_lens <= ctx_lens).all()), (q_lens, ctx_lens)
        assert int(q_lens.sum()) == slots.shape[0], (q_lens, slots.shape)
        self.num_heads, self.kv_heads, self.head_dim, self.num_slots = num_heads, kv_heads, head_dim, num_slots
        self.tokens = slots.shape[0]
        self.q_shape = (self.tokens, num_heads, head_dim)  # what each layer's call must match
        self.kv_shape = (self.tokens, kv_heads, head_dim)
        self.pages_shape = (kv_heads, num_slots, head_dim)
        self.kv_dtype = kv_dtype  # the dense pages' element type
        self.quantized = quantized
        self.struct = Plan(
            batch, num_heads, kv_heads, head_dim, page_size, block_tables.shape[1], self.tokens,
            *((QUANTIZED_TYPES[f] for f in quantized) if quantized else (KV_TYPES[kv_dtype],) * 2), num_slots, scale,
            *(t.data_ptr() for t in self.tensors),
        )  # fmt: skip
        self.ref = ctypes.byref(self.struct)


Pages = torch.Tensor | kv_quant.PageTensor  # dense pages [KVH, slots, D], or quantized ones


def page_pointers(plan: AttentionPlan, k_pages: Pages, v_pages: Pages, rotation: PageRotation | None) -> tuple:
    """The pages as the C calls take them, checked against the plan: (key elements, key scales, value elements,
    value scales, rotation); dense pages (tensors of the plan's kv_dtype) have no scales and no rotation,
    quantized ones (kv_quant.PageTensor of the plan's `quantized` formats) both."""
    if plan.quantized is None:
        for pages in (k_pages, v_pages):
            assert pages.shape == plan.pages_shape and pages.dtype == plan.kv_dtype and pages.is_contiguous()
        assert rotation is None, "dense pages hold rows as they are"
        return k_pages.data_ptr(), None, v_pages.data_ptr(), None, None
    assert plan.quantized == (k_pages.fmt, v_pages.fmt), (plan.quantized, k_pages.fmt, v_pages.fmt)
    assert k_pages.rule == v_pages.rule == rotation.rule, (k_pages.rule, v_pages.rule, rotation.rule)
    for pages in (k_pages, v_pages):
        assert pages.data.shape[:2] == plan.pages_shape[:2] and pages.data.is_contiguous()
        assert pages.scales.shape == (*plan.pages_shape[:2], plan.head_dim // 32) and pages.scales.is_contiguous()
    k_ptrs, v_ptrs = ((t.data.data_ptr(), t.scales.data_ptr()) for t in (k_pages, v_pages))
    return *k_ptrs, *v_ptrs, rotation.ref


def paged_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    threads: int = 1,
) -> torch.Tensor:
    """Write k/v [T, KVH, D] (float32) into the dense pages [KVH, slots, D] of the plan's kv_dtype (float32, float16
    or bfloat16, rounded as torch converts, float16 saturating at +-65504: `to_pages`) at the plan's slots, then
    return [T, H, D]: each new row's causal attention over its request's context (q [T, H, D]), the same bits for
    any `threads`."""
    assert plan.quantized is None, "quantized pages: paged_attention_quantized"
    return _attend(plan, q, k, v, page_pointers(plan, k_pages, v_pages, None), threads)


def paged_attention_quantized(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: kv_quant.PageTensor,
    v_pages: kv_quant.PageTensor,
    rotation: PageRotation,
    threads: int = 1,
) -> torch.Tensor:
    """Quantized pages (kv_quant.PageTensor of the plan's `quantized` formats): this step's k/v [T, KVH, D]
    (float32, as the model computed them) multiplied by the rotation's matrices and quantized into their slots as
    kv_quant.quantize_rows quantizes (bit for bit: `quantize_rows`), then [T, H, D]: each new row's causal attention
    (q [T, H, D] float32, rotated alike) over its request's context, each element read as its code's value times its
    block's scale (the float32 kv_quant's dequantization gives) with the dense kernel's arithmetic, rotated back:
    a row's bits do not depend on what else the step holds."""
    assert plan.quantized is not None, "dense pages: paged_attention"
    return _attend(plan, q, k, v, page_pointers(plan, k_pages, v_pages, rotation), threads)


def _attend(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: tuple, threads: int):
    """The C call: this step's rows (stored into the pages) and `page_pointers`."""
    q_stride = cpu_ops.heads_view(q, plan.q_shape)
    k_stride, v_stride = cpu_ops.heads_view(k, plan.kv_shape), cpu_ops.heads_view(v, plan.kv_shape)
    out = torch.empty(*plan.q_shape)
    status = _library().paged_attention(
        plan.ref, q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride, *pages, out.data_ptr(),
        threads,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("cpu_attention.paged_attention: no memory for a row of scores")
    return out


def quantize_rows(
    x: torch.Tensor, fmt: str, rule: str, mat: torch.Tensor | None = None, hadamard: int = 0, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [n, D] (float32) rotated as the kernel rotates a key (mat [D, D], `rotate_rows_ref`; else R in blocks
    of `hadamard` times `scale`, `hadamard_rows_ref`; 0: as they are) and quantized as it stores them: (codes,
    scales) of kv_quant.quantize_rows(rotated, fmt, rule), which tests hold equal bit for bit."""
    n, d = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and d % 32 == 0, (x.dtype, x.shape)
    codes = torch.empty(n, kv_quant.code_bytes(fmt, d), dtype=torch.uint8)
    scales = torch.empty(n, d // 32, dtype=torch.uint8)
    m = None if mat is None else mat.float().contiguous()
    _library().quantize_rows(
        n, d, QUANTIZED_TYPES[fmt], mxfp4.RULES.index(rule), x.data_ptr(), x.stride(0),
        None if m is None else m.data_ptr(), hadamard, scale, codes.data_ptr(), scales.data_ptr(),
    )  # fmt: skip
    return codes, scales


def to_pages(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the kernel stores them in dense pages of dtype: torch's rounding, float16 saturating at +-65504."""
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def rotate_rows_ref(x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ mat, summed as the kernel sums it: x[..., 0] mat[0] + x[..., 1] mat[1] + ... in that order, float32
    products and sums (bit for bit). mat [D, D], or [..., D, D] broadcast against x's heads."""
    y = x[..., 0:1] * mat[..., 0, :]
    for d in range(1, x.shape[-1]):
        y = y + x[..., d : d + 1] * mat[..., d, :]
    return y


def hadamard_rows_ref(x: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """x [..., D] @ R (the block-diagonal Sylvester-Hadamard matrix, blocks of `block`, entries +-scale) by the
    kernel's butterflies, bit for bit: in each block, for h = 1, 2, ..., block / 2, every pair (j, j + h) of a group
    of 2h becomes (a + b, a - b); then times the scale. block 0: x."""
    if block == 0:
        return x
    shape = x.shape
    y = x.reshape(*shape[:-1], shape[-1] // block, block)
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * torch.tensor(scale, dtype=torch.float32)).reshape(shape)


def paged_attention_quantized_ref(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: kv_quant.PageTensor,
    v_pages: kv_quant.PageTensor,
    rotation: PageRotation,
    threads: int = 1,
) -> torch.Tensor:
    """paged_attention_quantized in torch: rotate (`rotate_rows_ref`), quantize into the pages with kv_quant, then
    attend over the dequantized pages and rotate back."""
    q_mat, k_mat = rotation.mats
    group = plan.num_heads // plan.kv_heads
    slots = plan.tensors[4]
    k_pages.write(slots, rotation.rows_ref(k, k_mat).contiguous())
    v_pages.write(slots, rotation.rows_ref(v, None).contiguous())
    if q_mat is not None and q_mat.dim() == 3:
        q_mat = q_mat.repeat_interleave(group, 0)  # [H, D, D]: each query head its KV head's
    keys, values = k_pages.read(slice(None), torch.float32), v_pages.read(slice(None), torch.float32)
    out = _attend_ref(plan, rotation.rows_ref(q, q_mat), keys, values)
    return rotation.rows_ref(out, None)


def _attend_ref(plan: AttentionPlan, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
    """Per request, gather its context from the pages [KVH, slots, D] and attend (every row causal)."""
    tables, starts, q_lens, ctx_lens, _ = plan.tensors
    page_size = plan.struct.page_size
    out = torch.empty(q.shape)
    group = plan.num_heads // plan.kv_heads
    for b in range(q_lens.shape[0]):
        n, c, start = int(q_lens[b]), int(ctx_lens[b]), int(starts[b])
        pos = torch.arange(c)
        ctx = tables[b].long()[pos // page_size] * page_size + pos % page_size
        keys = k_pages[:, ctx].float().repeat_interleave(group, 0)  # [H, c, D]
        values = v_pages[:, ctx].float().repeat_interleave(group, 0)
        scores = torch.einsum("thd,hcd->htc", q[start : start + n], keys) * plan.struct.scale  # [H, n, c]
        seen = pos[None, :] <= (c - n + torch.arange(n))[:, None]  # [n, c]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("htc,hcd->thd", probs, values)
    return out


def paged_attention_ref(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor
) -> torch.Tensor:
    """The same by indexing: store k/v at the slots, then per request gather its context and attend."""
    slots = plan.tensors[4]
    k_pages[:, slots] = to_pages(k.transpose(0, 1), k_pages.dtype)
    v_pages[:, slots] = to_pages(v.transpose(0, 1), v_pages.dtype)
    return _attend_ref(plan, q, k_pages, v_pages)
