"""The floor under issue 14's GEMV goal: what any kernel that only reads an 8B linear's MXFP4 bytes takes, in the
GEMV harness, beside the MXFP4 GEMV itself (H200; CUDA graphs cycling weight copies past the L2, as
benchmarks/mxfp4_matmul.py times).

    PYTHONPATH=. python benchmarks/gemv_floor.py [--shapes 4096x4096,...]

Per shape (its packed codes + scales):
- empty: a Triton kernel of 132 programs that does nothing: a graph node's launch floor.
- stream: a Triton kernel that reads the bytes once with 16-byte loads and keeps one sum per program (no
  compute, no reduction across programs); the best of a grid of launches: one tile per program, or a program per
  SM times 1-8 looping over a contiguous slice.
- the MXFP4 GEMV at M = 1 (choose_config's launch), without and with PDL (with PDL the graph's next GEMV
  launches early and prefetches its first weight iterations into the L2, as in a decode step).
The % column is of the 4.28 TB/s copy ceiling (docs/GPU.md). Prints one table; $OUT/gemv_floor.md when OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mxfp4_matmul import (
    COPY_CEILING_TBPS,
    LLAMA_8B_SHAPES,
    graph_time_us,
    l2_defeat_copies,
    random_weight,
    weight_copies,
)

from specchat.kernels import mxfp4_matmul_kernel as mm
from specchat.kernels import pdl

STREAM_LAUNCHES = (  # (words per tile, warps, programs per SM; 0: one tile per program)
    (1024, 4, 0),
    (2048, 8, 0),
    (4096, 8, 0),
    (1024, 4, 4),
    (2048, 8, 2),
    (2048, 8, 4),
    (4096, 8, 1),
    (4096, 8, 2),
    (1024, 4, 8),
)


@triton.jit
def _empty_kernel(out_ptr):
    pass


@triton.jit
def _stream_kernel(words_ptr, out_ptr, n_words, tiles_per_program, BLOCK: tl.constexpr):
    """Sum of this program's contiguous tiles of int32 words (16-byte loads), one int32 out per program."""
    pid = tl.program_id(0)
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK), BLOCK), BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    start = pid * tiles_per_program
    for t in range(start, start + tiles_per_program):
        idx = t * BLOCK + offs
        acc += tl.load(words_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def stream_call(words: torch.Tensor, out: torch.Tensor, block: int, warps: int, per_sm: int):
    n = words.numel()
    tiles = -(-n // block)
    programs = tiles if per_sm == 0 else torch.cuda.get_device_properties(0).multi_processor_count * per_sm
    per_program = -(-tiles // programs)
    programs = -(-tiles // per_program)
    return lambda: _stream_kernel[(programs,)](words, out, n, per_program, BLOCK=block, num_warps=warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in LLAMA_8B_SHAPES))
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    empty_us = graph_time_us([lambda: _empty_kernel[(sms,)](out)])
    lines = [
        f"GEMV floor, {torch.cuda.get_device_name()}, {now}, commit {commit}, `{' '.join(sys.argv)}`; "
        f"us per call in CUDA graphs, weights cycled past the L2; an empty kernel: {empty_us:.2f} us",
        "",
        "| N x K | MB | at the ceiling us | stream us (% of ceiling) | stream launch | GEMV us (%) | GEMV + PDL us (%) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    print(lines[0], flush=True)
    for n, k in shapes:
        _, codes, scales, weight = random_weight(n, k)
        nbytes = codes.numel() + scales.numel()
        buffers = [torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
                   for _ in range(l2_defeat_copies(nbytes))]  # fmt: skip
        stream = {}
        for block, warps, per_sm in STREAM_LAUNCHES:
            calls = [stream_call(b, out, block, warps, per_sm) for b in buffers]
            stream[(block, warps, per_sm)] = graph_time_us(calls)
        best = min(stream, key=stream.get)
        weights = weight_copies(weight, nbytes)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemv = graph_time_us([lambda w=w, x=x: mm.mxfp4_matmul_triton(x, w) for w in weights])
        with pdl.override(True):
            gemv_pdl = graph_time_us([lambda w=w, x=x: mm.mxfp4_matmul_triton(x, w) for w in weights])
        ideal = nbytes / (COPY_CEILING_TBPS * 1e6)

        def pct(us: float, ideal: float = ideal) -> str:
            return f"{us:.2f} ({100 * ideal / us:.0f}%)"

        lines.append(
            f"| {n} x {k} | {nbytes / 1e6:.1f} | {ideal:.2f} | {pct(stream[best])} | {best} | {pct(gemv)} | "
            f"{pct(gemv_pdl)} |"
        )
        print(lines[-1], "all stream launches:", {key: round(us, 2) for key, us in stream.items()}, flush=True)
        del buffers, weights
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_floor.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
