"""The CPU's MXFP4 kernels on the default model's shapes: float rows (kernels/cpu_gemv.py `fp4_gemm`) against int8
rows (kernels/cpu_gemv_i8.py `fp4i8_gemm`), beside the GGUF blocks' int8 kernel (Q4_1, the head Q8_0).

    python benchmarks/cpu_fp4_gemv.py [--threads 1] [--rows 1 5] [--repeats 40] [--plain]

Random weights of SmolLM2-135M's shapes (fused wqkv 960x576, wo 576x576, fused gate_up 3072x576, down 576x1536, 30
layers each, the tied head 49152x576), MXFP4 by the ocp rule, rotated (RotatedFp4Linear's kernels, as the cached
GPTQ checkpoint's; `--plain` for Fp4Linear's). Calls through the Bound wrappers, interleaved; the median per call
and the per-token total (30 layers + head) in a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from specchat.kernels import cpu_gemv, cpu_gemv_i8
from specchat.kernels.mxfp4 import quantize_mxfp4

SHAPES = [  # name, N, K, times per token
    ("wqkv", 960, 576, 30),
    ("wo", 576, 576, 30),
    ("gate_up", 3072, 576, 30),
    ("down", 576, 1536, 30),
    ("head", 49152, 576, 1),
]
KINDS = ("fp4 float rows", "fp4 int8 rows", "GGUF int8 rows")


def kernels(n: int, k: int, rotate: bool, head: bool) -> tuple:
    """(float-row MXFP4, int8-row MXFP4, int8-row GGUF) bound weights of one shape."""
    g = torch.Generator().manual_seed(n + k)
    codes, scales = quantize_mxfp4(torch.randn(n, k, generator=g))
    fp4_float = cpu_gemv.Bound(codes, scales, rotate=rotate)
    fp4_int8 = cpu_gemv_i8.Fp4Bound(*cpu_gemv_i8.repack_fp4(codes, scales), n, rotate=rotate)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # GGUF's scales are float16
    if head:
        gguf = cpu_gemv_i8.Bound(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d)
    else:
        gguf = cpu_gemv_i8.Bound(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, -d * 8)
    return fp4_float, fp4_int8, gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--plain", action="store_true", help="Fp4Linear's kernels (no block rotation of x)")
    args = ap.parse_args()
    assert cpu_gemv_i8.available(), "the int8 kernels do not load here (no AVX512-VNNI or AVX2)"
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        loadavg = " ".join(f.read().split()[:3])
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, threads {args.threads}, "
          f"{'plain' if args.plain else 'rotated'} MXFP4, load average {loadavg}\n")  # fmt: skip
    print(f"| shape | rows | {' (us) | '.join(KINDS)} (us) | int8 rows vs float |")
    print("|---|---:|---:|---:|---:|---:|")
    totals = {(rows, kind): 0.0 for rows in args.rows for kind in KINDS}
    for name, n, k, count in SHAPES:
        bound = kernels(n, k, not args.plain, name == "head")
        for rows in args.rows:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            times: list[list[float]] = [[] for _ in KINDS]
            for _ in range(args.repeats):
                for kernel, spent in zip(bound, times, strict=True):
                    t0 = time.perf_counter()
                    kernel(x, args.threads)
                    spent.append(time.perf_counter() - t0)
            med = [statistics.median(t) * 1e6 for t in times]
            for kind, us in zip(KINDS, med, strict=True):
                totals[(rows, kind)] += us * count
            cells = " | ".join(f"{us:.1f}" for us in med)
            print(f"| {name} {n}x{k} | {rows} | {cells} | {med[0] / med[1]:.2f}x |")
    print(f"\n| rows | per token: {' (ms) | '.join(KINDS)} (ms) | int8 rows vs float |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        ms = [totals[(rows, kind)] / 1e3 for kind in KINDS]
        print(f"| {rows} | {' | '.join(f'{t:.2f}' for t in ms)} | {ms[0] / ms[1]:.2f}x |")


if __name__ == "__main__":
    main()
