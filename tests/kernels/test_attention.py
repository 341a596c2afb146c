"""Paged attention: the torch reference against plain softmax attention, and the Triton kernel against the reference.

The kernel tests run on CUDA, or on CPU under TRITON_INTERPRET=1. Triton reads that variable when a kernel is
defined, so on a CPU-only machine `test_kernels_under_interpreter` reruns this file in a subprocess with it set.
"""

from __future__ import annotations

import os

import pytest
import torch

from specchat.kernels.attention import (
    MAX_BLOCK_M,
    AttentionMetadata,
    causal_attention,
    fill_partitions,
    paged_attention_reference,
    paged_attention_supported,
)
from specchat.kernels.attention_triton import DECODE_BITS, DECODE_E4M3, paged_attention
from specchat.kernels.kv_quant import PageTensor
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

PAGE_FORMATS = {  # name -> (key element format, value element format, page dtype)
    "fp32": ("dense", "dense", torch.float32),
    "fp16": ("dense", "dense", torch.float16),
    "bf16": ("dense", "dense", torch.bfloat16),
    "mxfp4": ("mxfp4", "mxfp4", torch.float32),
    "k8v4": ("mxfp8", "mxfp4", torch.float32),
}


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Row by row softmax(q k^T) v with the causal and GQA rules written out; k/v [KVH, ctx, D]."""
    q_len, num_heads, _ = q.shape
    kv_heads, ctx_len, _ = k.shape
    out = torch.empty_like(q)
    for i in range(q_len):
        for h in range(num_heads):
            kh = h // (num_heads // kv_heads)
            seen = ctx_len - q_len + i + 1
            weights = torch.softmax(k[kh, :seen] @ q[i, h] * scale, dim=0)
            out[i, h] = weights @ v[kh, :seen]
    return out


@pytest.mark.parametrize(
    ("q_len", "ctx_len", "num_heads", "kv_heads"),
    [(1, 9, 4, 2), (5, 5, 6, 3), (4, 23, 8, 2), (40, 40, 9, 3), (40, 75, 9, 3)],  # the last two: prompts (SDPA)
)
def test_causal_attention_equals_naive(q_len, ctx_len, num_heads, kv_heads):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(q_len, num_heads, 16, generator=gen)
    k, v = torch.randn(2, kv_heads, ctx_len, 16, generator=gen)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3), naive_attention(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's fused CUDA kernels")
@pytest.mark.parametrize("ctx_len", [40, 75])
def test_prompt_attention_runs_a_fused_kernel_on_cuda(ctx_len):
    """A prompt's attention on CUDA in bf16 runs flash attention (fresh) or the memory-efficient kernel (after
    cached context), not SDPA's math fallback (which a 3-d input or GQA with a mask would fall back to, at ~0.5 ms
    of host time per layer), and equals the fp32 reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(40, 9, 64, generator=gen)
    k, v = torch.randn(2, 3, ctx_len, 64, generator=gen)
    backend = SDPBackend.FLASH_ATTENTION if ctx_len == 40 else SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel([backend]):  # raises if the inputs do not suit that kernel
        out = causal_attention(*(t.cuda().bfloat16() for t in (q, k, v)), 0.125)
    torch.testing.assert_close(out.float().cpu(), naive_attention(q, k, v, 0.125), atol=2e-2, rtol=2e-2)


def random_paged_batch(
    page_format: str,
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int = 16,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, PageTensor, PageTensor, AttentionMetadata, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Requests with random keys/values written to shuffled pages; also returns each request's rows [KVH, ctx, D]."""
    k_fmt, v_fmt, dtype = PAGE_FORMATS[page_format]
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in ctx_lens) + 3
    k_pages = PageTensor.empty(k_fmt, kv_heads, num_pages * page_size, head_dim, dtype, device, "mse")
    v_pages = PageTensor.empty(v_fmt, kv_heads, num_pages * page_size, head_dim, dtype, device, "mse")
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables, rows = [], []
    for ctx_len in ctx_lens:
        table = [free.pop() for _ in range(-(-ctx_len // page_size))]
        pos = torch.arange(ctx_len)
        slots = (torch.tensor(table)[pos // page_size] * page_size + pos % page_size).to(device)
        # keys with a few outlier channels, as real ones have
        k = torch.randn(ctx_len, kv_heads, head_dim, generator=gen) * (1 + 4 * (torch.arange(head_dim) % 17 == 0))
        v = torch.randn(ctx_len, kv_heads, head_dim, generator=gen)
        k_pages.write(slots, k.to(device))
        v_pages.write(slots, v.to(device))
        tables.append(table)
        rows.append((k_pages.read(slots, torch.float32), v_pages.read(slots, torch.float32)))
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device, dtype)
    meta = AttentionMetadata.build(tables, q_lens, ctx_lens, page_size, device)
    return q, k_pages, v_pages, meta, rows


def test_reference_reads_pages_in_position_order():
    q_lens, ctx_lens = [1, 3], [20, 35]
    q, k_pages, v_pages, meta, rows = random_paged_batch("fp32", q_lens, ctx_lens, 4, 2, 32)
    out = paged_attention_reference(q, k_pages, v_pages, meta, 0.2)
    start = 0
    for n, (k, v) in zip(q_lens, rows, strict=True):
        expected = naive_attention(q[start : start + n], k, v, 0.2)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_supported_shapes():
    assert paged_attention_supported(128, 4, 17)
    assert not paged_attention_supported(128, 8, MAX_BLOCK_M // 8 + 1)
    assert not paged_attention_supported(96, 1, 1)


def test_wrapper_rejects_what_it_cannot_run():
    q, k_pages, v_pages, meta, _ = random_paged_batch("fp32", [MAX_BLOCK_M // 2 + 1], [80], 4, 2, 32)
    with pytest.raises(AssertionError):
        paged_attention(q, k_pages, v_pages, meta, 0.2)


CASES = {
    # name: (page format, q_lens, ctx_lens, heads, kv heads, head_dim, partitions)
    "decode-ragged": ("fp32", [1, 1, 1], [1, 16, 47], 4, 2, 32, None),
    "verify-page-boundaries": ("fp32", [5, 2, 1], [17, 32, 33], 4, 1, 32, 3),
    "fp16-gqa4": ("fp16", [3, 1], [40, 64], 8, 2, 64, 2),
    "bf16": ("bf16", [2, 4], [31, 50], 4, 2, 64, None),
    "mxfp4-decode": ("mxfp4", [1, 1], [70, 9], 4, 2, 64, 2),
    "mxfp4-verify": ("mxfp4", [5, 3], [21, 90], 8, 2, 128, 3),
    "k8v4-verify": ("k8v4", [4, 1], [48, 130], 4, 2, 64, 2),
    "k8v4-d128": ("k8v4", [1, 2], [100, 33], 8, 2, 128, 2),  # 4 scale bytes per row: one int32 word
    "mxfp4-d32": ("mxfp4", [1, 3], [19, 40], 4, 2, 32, None),  # 1 scale byte per row
    "mxfp4-d256": ("mxfp4", [1, 2], [40, 20], 4, 2, 256, None),  # 8 scale bytes per row: two words
}


@kernel_test
@pytest.mark.parametrize("key_rows", [False, True], ids=["query-rows", "key-rows"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_reference(case, key_rows):
    page_format, q_lens, ctx_lens, num_heads, kv_heads, head_dim, parts = CASES[case]
    q, k_pages, v_pages, meta, _ = random_paged_batch(
        page_format, q_lens, ctx_lens, num_heads, kv_heads, head_dim, seed=len(case), device=DEVICE
    )
    scale = head_dim**-0.5
    expected = paged_attention_reference(q, k_pages, v_pages, meta, scale).float()
    got = paged_attention(q, k_pages, v_pages, meta, scale, num_partitions=parts, key_rows=key_rows).float()
    # dense fp32 is exact up to summation order; 16-bit pages and decoded tiles go through fp16/bf16 dots
    tol = 1e-5 if page_format == "fp32" else (2e-2 if page_format == "bf16" else 4e-3)
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm_89+"
)
@pytest.mark.parametrize("case", ["mxfp4-verify", "k8v4-d128", "mxfp4-d256"])
def test_decodes_agree_on_the_gpu(case):
    """Codes converted through E4M3 (sm_89+) give the same tiles, so the same output bit for bit, as codes whose
    bits are placed into fp16 (the decode of older GPUs)."""
    page_format, q_lens, ctx_lens, num_heads, kv_heads, head_dim, parts = CASES[case]
    q, k_pages, v_pages, meta, _ = random_paged_batch(
        page_format, q_lens, ctx_lens, num_heads, kv_heads, head_dim, seed=3, device="cuda"
    )
    runs = [
        paged_attention(q, k_pages, v_pages, meta, head_dim**-0.5, num_partitions=parts, decode=decode)
        for decode in (DECODE_BITS, DECODE_E4M3)
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default partition count is CUDA's")
@pytest.mark.parametrize(
    ("page_format", "q_lens", "ctx_lens"),
    [("mxfp4", [5], [3000]), ("k8v4", [1] * 8, [1500] * 8), ("bf16", [5] * 4, [2100, 700, 64, 1300])],
)
def test_default_partitions_on_the_gpu(page_format, q_lens, ctx_lens):
    """The partition count the kernel's measured occupancy picks (compiled once, unspecialised partials'
    strides) gives the reference's output, long contexts split into many slices."""
    q, k_pages, v_pages, meta, _ = random_paged_batch(page_format, q_lens, ctx_lens, 32, 8, 128, seed=5, device="cuda")
    expected = paged_attention_reference(q, k_pages, v_pages, meta, 128**-0.5).float()
    got = paged_attention(q, k_pages, v_pages, meta, 128**-0.5).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_fill_partitions_fills_whole_waves():
    """H200 (132 SMs): decode grids round per_sm to whole waves of resident programs, verification grids take one
    wave; never a partial wave past the last whole one."""
    assert fill_partitions(64, 132, resident=3, per_sm=8, max_q_len=1) == 18  # 3 waves of 396: 1,152 programs
    assert fill_partitions(8, 132, resident=2, per_sm=8, max_q_len=5) == 33  # one wave of 264
    assert fill_partitions(64, 132, resident=4, per_sm=4, max_q_len=5) == 8  # 512 of 528 (9 ran 1.3x slower)
    assert fill_partitions(64, 132, resident=5, per_sm=4, max_q_len=1) == 10  # 4 / 5 rounds to one wave
    assert fill_partitions(2048, 132, resident=3, per_sm=8, max_q_len=1) == 1  # more heads than slots
    for batch_heads in (1, 3, 8, 24, 64, 200, 500):
        for resident in (1, 2, 3, 5):
            for per_sm, q in ((8, 1), (4, 1), (8, 5)):
                parts = fill_partitions(batch_heads, 132, resident, per_sm, q)
                waves = 1 if q > 1 else max(1, round(per_sm / resident))
                assert parts * batch_heads <= max(batch_heads, waves * resident * 132) < (parts + 1) * batch_heads


@subprocess_test
def test_kernels_under_interpreter():
    files = [__file__, os.path.join(os.path.dirname(__file__), "test_attention_quantize.py")]
    run_under_interpreter(files, "kernel or triton")
