"""Paged decode attention on the GPU: MXFP4 and k8v4 pages vs bf16 pages vs torch SDPA on contiguous bf16.

    python benchmarks/attention.py [--contexts 1024,8192,32768] [--batches 1,16] [--sweep]

Llama-3.1-8B attention shape: 32 query heads, 8 KV heads, head_dim 128, one layer, page size 16, pages in a
shuffled order (as a busy pool hands them out). Times are per call of the whole `paged_attention` (attention
kernel + partition merge), replayed as a CUDA graph of 20 calls (as the engine's steps run them: no host launch
cost) that cycle through copies of the pages until they span 256 MB, so the KV comes from DRAM, not the L2
(`mxfp4_matmul.graph_time_us`; median of 15 replays). Until 2026-12-03 the times were `triton.testing.do_bench`
medians of eager calls, which put the host's launch work into the short rows (8k context and less). Bandwidth counts
the KV bytes the call must read (keys + values, block scales included) over that time; the ceiling is the
H200's measured 4.28 TB/s device copy (../shared/GPU.md). Rows with q=5 are speculative verification (4
drafts + 1 per request, causal among them). --sweep also times launch settings around the defaults at the
longest context given (every q given), then prints the best three of each case beside the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from specchat.kernels.attention import AttentionMetadata, paged_attention_reference
from specchat.kernels.attention_triton import paged_attention
from specchat.kernels.kv_quant import DENSE, MXFP4, MXFP8, PageTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mxfp4_matmul import graph_time_us, l2_defeat_copies

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
COPY_CEILING = 4.28e12  # bytes/s, H200 device-to-device copy (read + write)
FORMATS = {"bf16": (DENSE, DENSE), "mxfp4": (MXFP4, MXFP4), "k8v4": (MXFP8, MXFP4)}
FILL_CHUNK = 1 << 16  # rows quantized at once while filling pages


def make_pages(fmt: str, batch: int, ctx: int, gen: torch.Generator) -> tuple[PageTensor, PageTensor, list[list[int]]]:
    """Random keys/values of `batch` requests of `ctx` tokens each, written into shuffled pages."""
    pages_per_seq = triton.cdiv(ctx, PAGE)
    num_slots = batch * pages_per_seq * PAGE
    k_fmt, v_fmt = FORMATS[fmt]
    k = PageTensor.empty(k_fmt, KV_HEADS, num_slots, HEAD_DIM, torch.bfloat16, "cuda", "mse")
    v = PageTensor.empty(v_fmt, KV_HEADS, num_slots, HEAD_DIM, torch.bfloat16, "cuda", "mse")
    order = torch.randperm(batch * pages_per_seq, generator=gen).tolist()
    tables = [order[b * pages_per_seq : (b + 1) * pages_per_seq] for b in range(batch)]
    for lo in range(0, num_slots, FILL_CHUNK):
        slots = torch.arange(lo, min(lo + FILL_CHUNK, num_slots), device="cuda")
        for pages in (k, v):
            pages.write(slots, torch.randn(len(slots), KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
    return k, v, tables


def kv_bytes(k: PageTensor, v: PageTensor, tokens: int) -> int:
    per_slot = sum(t.data[:, :1].nbytes + (0 if t.scales is None else t.scales[:, :1].nbytes) for t in (k, v))
    return per_slot * tokens


def page_copies(k: PageTensor, v: PageTensor, tokens: int) -> list[tuple[PageTensor, PageTensor]]:
    """The pages and enough clones of them that a graph cycling through all reads its KV from DRAM."""
    copies = l2_defeat_copies(kv_bytes(k, v, tokens))

    def clone(t: PageTensor) -> PageTensor:
        return dataclasses.replace(t, data=t.data.clone(), scales=None if t.scales is None else t.scales.clone())

    return [(k, v)] + [(clone(k), clone(v)) for _ in range(copies - 1)]


def bench_paged(q, copies, meta, scale, **launch) -> float:
    """Seconds per `paged_attention` call, replayed in a CUDA graph over the page copies."""
    calls = [lambda k=k, v=v: paged_attention(q, k, v, meta, scale, **launch) for k, v in copies]
    return graph_time_us(calls) * 1e-6


def bench_sdpa(q: torch.Tensor, batch: int, ctx: int) -> tuple[float, int]:
    """SDPA over contiguous bf16 [B, KVH, ctx, D] (grouped-query), timed as `bench_paged`: seconds and KV bytes."""
    rows = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    nbytes = 2 * batch * KV_HEADS * ctx * HEAD_DIM * 2
    kvs = []
    for _ in range(l2_defeat_copies(nbytes)):
        k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kvs.append((k, torch.randn_like(k)))
    calls = [lambda k=k, v=v: F.scaled_dot_product_attention(rows, k, v, enable_gqa=True) for k, v in kvs]
    return graph_time_us(calls) * 1e-6, nbytes


def check(q, k, v, meta, scale) -> float:
    """Largest error of the kernel against the reference on the first request (a spot check on real shapes)."""
    one = AttentionMetadata(
        meta.block_tables[:1],
        meta.q_starts[:1],
        meta.q_lens[:1],
        meta.ctx_lens[:1],
        meta.max_q_len,
        meta.max_ctx_len,
        PAGE,
    )
    rows = q[: meta.max_q_len]
    ref = paged_attention_reference(rows, k, v, one, scale).float()
    return (paged_attention(rows, k, v, one, scale).float() - ref).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--q-lens", default="1,5")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--profile", metavar="FORMAT", help="for ncu: 5 plain calls at the first context and batch")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    if args.profile:  # ncu -k regex:_paged_attention_kernel --launch-skip 4 --launch-count 1 ...
        ctx, batch = int(args.contexts.split(",")[0]), int(args.batches.split(",")[0])
        k, v, tables = make_pages(args.profile, batch, ctx, gen)
        meta = AttentionMetadata.build(tables, [1] * batch, [ctx] * batch, PAGE, "cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            paged_attention(q, k, v, meta, scale)
        torch.cuda.synchronize()
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name()
    print(
        f"{date.today()} · {device} · torch {torch.__version__} · triton {triton.__version__} · {platform.python_version()} · commit {commit}"
    )
    print(f"{HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, page {PAGE}; CUDA graphs, KV past the L2\n")
    print(
        "| context | batch | q | kernel | time (us) | KV read (MB) | GB/s | of 4.28 TB/s | vs bf16 pages | max err vs ref |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    sweep_rows = []
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts)
    for ctx in contexts:
        for batch in map(int, args.batches.split(",")):
            pages = {fmt: make_pages(fmt, batch, ctx, gen) for fmt in FORMATS}
            copies = {fmt: page_copies(k, v, batch * ctx) for fmt, (k, v, _) in pages.items()}
            for q_len in map(int, args.q_lens.split(",")):
                if q_len > 1 and ctx != longest:
                    continue  # verification: the longest context only
                tables = pages["bf16"][2]
                meta = AttentionMetadata.build(tables, [q_len] * batch, [ctx] * batch, PAGE, "cuda")
                q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                times = {}
                for fmt, (k, v, _) in pages.items():
                    t = bench_paged(q, copies[fmt], meta, scale)
                    times[fmt] = t
                    nbytes = kv_bytes(k, v, batch * ctx)
                    err = check(q, k, v, meta, scale)
                    print(
                        f"| {ctx} | {batch} | {q_len} | {fmt} pages | {t * 1e6:.1f} | {nbytes / 1e6:.1f} | "
                        f"{nbytes / t / 1e9:.0f} | {nbytes / t / COPY_CEILING:.0%} | {times['bf16'] / t:.2f}x | {err:.1e} |",
                        flush=True,
                    )
                if q_len == 1:  # SDPA on contiguous bf16 [B, KVH, ctx, D] (grouped-query)
                    t, nbytes = bench_sdpa(q, batch, ctx)
                    print(
                        f"| {ctx} | {batch} | 1 | torch SDPA, contiguous bf16 | {t * 1e6:.1f} | {nbytes / 1e6:.1f} | "
                        f"{nbytes / t / 1e9:.0f} | {nbytes / t / COPY_CEILING:.0%} | {times['bf16'] / t:.2f}x | - |",
                        flush=True,
                    )
                if args.sweep and ctx == longest:
                    for fmt in FORMATS:
                        default = times[fmt]
                        for launch in sweep_launches(batch):
                            try:
                                t = bench_paged(q, copies[fmt], meta, scale, **launch)
                            except Exception as error:  # a launch that does not compile or fit: report, go on
                                print(f"{fmt} q={q_len} {launch}: {type(error).__name__}: {error}"[:300], flush=True)
                                continue
                            sweep_rows.append((batch, q_len, fmt, launch, t, default))
            del pages, copies
            torch.cuda.empty_cache()
    if sweep_rows:
        print(f"\nLaunch sweep at context {longest} (`paged_attention`'s launch settings; stages - = the default):\n")
        print("| batch | q | pages | key rows | block_n | warps | stages | registers | partitions | time (us) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for batch, q_len, fmt, launch, t, _ in sweep_rows:
            print(f"| {batch} | {q_len} | {fmt} | {_launch_cells(launch)} | {t * 1e6:.1f} |")
        print("\nBest launches against the default (the table above):\n")
        print(
            "| batch | q | pages | default (us) | best (us) | key rows | block_n | warps | stages | registers | partitions |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        cases = dict.fromkeys((batch, q_len, fmt) for batch, q_len, fmt, *_ in sweep_rows)
        for case in cases:
            rows = sorted((r for r in sweep_rows if r[:3] == case), key=lambda r: r[4])
            for *_, launch, t, default in rows[:3]:
                print(
                    f"| {' | '.join(map(str, case))} | {default * 1e6:.1f} | {t * 1e6:.1f} | {_launch_cells(launch)} |"
                )


def _launch_cells(launch: dict) -> str:
    return (
        f"{launch['key_rows']} | {launch['block_n']} | {launch['num_warps']} | {launch.get('num_stages', '-')} | "
        f"{launch.get('max_registers', '-')} | {launch['num_partitions']}"
    )


def sweep_launches(batch: int) -> list[dict]:
    """Launch settings around the defaults: MMA orientation x tile x warps x partitions (1 to 16 programs per
    SM), and at 128-key tiles the pipeline depth and a 128-register cap (four programs per SM instead of
    three)."""
    launches = []
    for key_rows in (False, True):
        for block_n in (64, 128):
            for warps in (4, 8):
                for per_sm in (1, 2, 4, 8, 16):
                    parts = max(1, round(per_sm * 132 / (batch * KV_HEADS)))
                    launch = dict(key_rows=key_rows, block_n=block_n, num_warps=warps, num_partitions=parts)
                    launches.append(launch)
                    if block_n == 128 and warps == 4 and per_sm == 8:
                        launches += [{**launch, "num_stages": stages} for stages in (2, 3, 4)]
                        launches += [
                            {**launch, "num_stages": 2, "max_registers": 128, "num_partitions": p}
                            for p in (parts, 2 * parts)
                        ]
    return launches


if __name__ == "__main__":
    main()
