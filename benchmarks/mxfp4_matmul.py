"""MXFP4 matmul on the GPU against torch bf16 and torch's int4 tinygemm on Llama-3.1-8B linear shapes.

    PYTHONPATH=. python benchmarks/mxfp4_matmul.py [--sweep] [--shapes 6144x4096,...] [--ms 1,2,4]
    ncu -k regex:_mxfp4_matmul ... python benchmarks/mxfp4_matmul.py --profile 128,2,1,4,3 --shapes 28672x4096 --ms 1
    (benchmarks/ncu_matmul.sh runs the cases docs/mxfp4.md's profile names)

Per shape and M: a correctness check of the Triton kernel against the torch reference (random weights
quantized by the reference quantizer), then the median time per call of the MXFP4 kernel, of torch bf16
F.linear and of `torch.ops.aten._weight_int4pack_mm` (tinygemm, int4 group 32, inner_k_tiles 8: what gpt-fast's
int4 model runs), all measured in CUDA graphs that cycle through enough weight copies to defeat the 50 MB L2.
Bandwidth counts the interchange bytes (packed codes + scales). --sweep also times a grid of launch configs
(GEMV ones for M <= 16, matmul ones above) and reports the best beside the default `choose_config`.
The markdown table is printed last and written to $OUT/mxfp4_matmul.md when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

LLAMA_8B_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DENSE_FROM = 128  # M from which the decoded weight times cuBLAS is timed too (mxfp4_linear's path for many rows)
COPY_CEILING_TBPS = 4.28  # H200 device-to-device copy, read + write (docs/GPU.md)
L2_DEFEAT_BYTES = 256 * 2**20  # weight copies per timing so that the working set is 5x the L2
CALLS_PER_GRAPH = 20
GRAPH_REPLAYS = 15
GEMV_SWEEP = (  # M <= 16: (block_n, tiles, num_warps, num_stages, block_m) x split_k
    (64, 1, 4, 4, 16),
    (64, 2, 4, 3, 16),
    (64, 2, 4, 4, 16),
    (64, 2, 4, 3, 8),
    (128, 2, 4, 3, 16),
    (128, 2, 8, 3, 16),
)
MATMUL_SWEEP = (  # M > 16 (block_m 0: choose_config's), split_k 1, 2, 4
    (64, 2, 4, 3, 0),
    (64, 2, 4, 3, 64),
    (64, 1, 4, 3, 64),
    (128, 1, 8, 3, 64),
    (64, 1, 4, 3, 128),
    (128, 2, 8, 2, 128),
    (64, 1, 4, 2, 256),
    (64, 1, 4, 3, 256),
    (128, 1, 8, 2, 256),
)
TWO_TILE_SWEEP = (  # M > 64, programs that reuse their decoded weights on a second tile of extra_m rows:
    # (block_n, tiles, num_warps, num_stages, block_m, extra_m) x split_k 1, 2, 4
    (64, 1, 4, 3, 64, 0),
    (64, 1, 4, 3, 128, 0),
    (128, 1, 8, 3, 128, 0),
    (64, 1, 4, 3, 64, 16),
    (64, 1, 4, 3, 64, 32),
    (64, 1, 4, 3, 64, 64),
    (64, 1, 4, 3, 128, 32),
    (64, 1, 4, 2, 128, 32),
    (128, 1, 8, 3, 128, 32),
    (128, 1, 8, 2, 128, 32),
    (64, 1, 4, 3, 128, 64),
    (128, 1, 8, 2, 128, 64),
    (64, 1, 4, 2, 128, 128),
    (128, 1, 8, 2, 128, 128),
)
SPLITS = (1, 2, 4, 8, 16, 32)  # M <= 16; M > 16 takes the first three
INT4_GROUP = 32  # gpt-fast int4 g32
INT4_INNER_K_TILES = 8


def _import_kernels():
    """specchat.kernels.mxfp4{,_layout,_matmul_kernel,_matmul}, by file path if the package's __init__ cannot be
    imported."""
    try:
        from specchat.kernels import mxfp4, mxfp4_layout, mxfp4_matmul, mxfp4_matmul_kernel

        return mxfp4, mxfp4_layout, mxfp4_matmul_kernel, mxfp4_matmul
    except ImportError:
        root = Path(__file__).resolve().parents[1] / "specchat" / "kernels"
        modules = []
        names = ("mxfp4", "mxfp4_layout", "mxfp4_dequant", "mxfp4_matmul", "mxfp4_matmul_kernel")
        for name in names:
            spec = importlib.util.spec_from_file_location(f"specchat.kernels.{name}", root / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            modules.append(module)
        return modules[0], modules[1], modules[4], modules[3]


mxfp4, layout, mm, linear = _import_kernels()


def graph_time_us(calls: list) -> float:
    """Median time per call (us) of the zero-argument callables, replayed as one CUDA graph."""
    for call in calls:  # compile, allocate workspaces
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(GRAPH_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def copy_bandwidth_tbps() -> float:
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)])
    return 2 * src.nbytes / us / 1e6


def check_special_blocks() -> str:
    """NaN blocks (HAS_NAN kernel) and block scales above 2 (exponent offset c > 0) against the reference."""
    torch.manual_seed(1)
    w = torch.randn(256, 512, device="cuda")
    w[3, 40] = float("nan")  # row 3, block 1 -> NaN
    w[7, 64:96] *= 1e30  # s > 128 -> c > 0
    w[9, 0:32] *= 1e-30  # tiny block, kept (within 2^125 of the largest)
    codes, scales = mxfp4.quantize_mxfp4(w)
    weight = layout.prepare_weight(codes, scales, 512)
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    y = mm.mxfp4_matmul_triton(x, weight).float()
    ref = x.float() @ mxfp4.dequantize_mxfp4(codes, scales).T
    same_nan = torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    error = ((y[finite] - ref[finite]).double().norm() / ref[finite].double().norm()).item()  # 1e31 ** 2
    line = f"special blocks: exp_offset {weight.exp_offset}, NaN columns match: {same_nan}, rel err {error:.1e}"
    assert same_nan and error < 1e-2 and weight.exp_offset > 0 and weight.has_nan, line
    return line


def random_weight(n: int, k: int):
    """A random [N, K] bf16 weight, its MXFP4 quantization and the prepared kernel weight."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    codes, scales = mxfp4.quantize_mxfp4(w)
    return w, codes, scales, layout.prepare_weight(codes, scales, k)


def check_matmul(weight, codes, scales, k: int, m: int) -> float:
    """Relative error of the fast kernel against x @ dequantize(W)^T in float32 (bf16 output rounding ~4e-3)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = mm.mxfp4_matmul_triton(x, weight)
    ref = x.float() @ mxfp4.dequantize_mxfp4(codes, scales, k=k).T
    error = ((y.float() - ref).norm() / ref.norm()).item()
    assert error < 1e-2 and torch.isfinite(y).all(), (m, error)
    return error


def l2_defeat_copies(nbytes: int) -> int:
    """How many copies of `nbytes` of weights the timing cycles through so that they do not stay in the L2."""
    return max(1, -(-L2_DEFEAT_BYTES // nbytes))


def weight_copies(weight, nbytes: int) -> list:
    """The prepared MXFP4 weight and random-code copies of it (same scales), `l2_defeat_copies` in all."""
    return [weight] + [
        dataclasses.replace(weight, codes=torch.randint_like(weight.codes, -(2**31), 2**31 - 1))
        for _ in range(l2_defeat_copies(nbytes) - 1)
    ]


def int4_copies(n: int, k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random int4 tinygemm weights (packed, scales-and-zeros [K/32, N, 2] bf16), as gpt-fast int4 packs them."""
    copies = []
    for _ in range(count):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(packed, INT4_INNER_K_TILES)
        scales_zeros = torch.randn(k // INT4_GROUP, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01
        copies.append((packed, scales_zeros))
    return copies


def sweep_configs(m: int, weight, two_tile: bool = False) -> set:
    iterations = weight.codes.shape[1]  # k-tiles
    configs = set()
    if two_tile:
        grid = [c for c in TWO_TILE_SWEEP if m > c[4] or c[5] == 0]  # a second tile only where rows reach it
    else:
        grid = [(*c, 0) for c in (GEMV_SWEEP if m <= 16 else MATMUL_SWEEP)]
    for block_n, tiles, warps, stages, block_m, extra_m in grid:
        for split in SPLITS if m <= 16 else SPLITS[:3]:
            # M <= 16 down to one k-step per program (what a bare read of the weights prefers), else two
            if split == 1 or iterations // (tiles * split) >= (1 if m <= 16 else 2):
                configs.add(mm.MatmulConfig(block_n, tiles, split, warps, stages, block_m, extra_m))
    return configs


def bench_shape(
    n: int, k: int, ms: tuple[int, ...], sweep: set[int], records: list[dict], two_tile: bool = False
) -> None:
    w, codes, scales, weight = random_weight(n, k)
    for m in (1, 16, 64, 300):
        error = check_matmul(weight, codes, scales, k, m)
        print(f"  check N={n} K={k} M={m}: rel err {error:.2e}", flush=True)
    mx_bytes = codes.numel() + scales.numel()
    mx_copies = weight_copies(weight, mx_bytes)
    bf_copies = [w] + [torch.randn_like(w) for _ in range(l2_defeat_copies(w.nbytes) - 1)]
    int4 = int4_copies(n, k, l2_defeat_copies(n * k // 2 + n * k // INT4_GROUP * 4))
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = graph_time_us([lambda x=x, wc=wc: F.linear(x, wc) for wc in bf_copies])
        int4_us = graph_time_us(
            [lambda x=x, p=p, sz=sz: torch.ops.aten._weight_int4pack_mm(x, p, INT4_GROUP, sz) for p, sz in int4]
        )  # no fallback: a failing baseline stops the run
        default = mm.choose_config(m, weight)
        configs = {default} | (sweep_configs(m, weight, two_tile) if m in sweep else set())
        timings = {}
        for config in configs:
            try:
                timings[config] = graph_time_us(
                    [lambda x=x, wc=wc, c=config: mm.mxfp4_matmul_triton(x, wc, c) for wc in mx_copies]
                )
            except Exception as error:  # e.g. out of shared memory for this config
                print(f"  config {config} failed: {type(error).__name__}: {str(error)[:120]}")
        best = min(timings, key=timings.get)
        dense_us = None
        if m >= DENSE_FROM:  # the weight decoded into scratch (by slabs), then cuBLAS
            scratch = linear.DequantScratch()
            dense_us = graph_time_us(
                [
                    lambda x=x, wc=wc, s=scratch: linear.dequantized_linear(x, wc, None, s, linear.DENSE_MAX_WEIGHTS)
                    for wc in mx_copies
                ]
            )
        record = dict(
            n=n, k=k, m=m, bf16_us=bf16_us, int4_us=int4_us, default_us=timings[default], best_us=timings[best],
            dense_us=dense_us,
            default=_short(default), best=_short(best), mx_bytes=mx_bytes,
            sweep={str(c): t for c, t in sorted(timings.items(), key=lambda item: item[1])[:5]},
        )  # fmt: skip
        records.append(record)
        print(
            f"  N={n} K={k} M={m}: bf16 {bf16_us:.1f} us, int4 {int4_us:.1f} us, mxfp4 default "
            f"{timings[default]:.1f} us {_short(default)}, best {timings[best]:.1f} us {_short(best)}"
            + (f", decoded + cuBLAS {dense_us:.1f} us" if dense_us else ""),
            flush=True,
        )
        if len(timings) > 1:
            print(
                "    top: "
                + ", ".join(f"{_short(c)} {t:.1f}" for c, t in sorted(timings.items(), key=lambda i: i[1])[:6])
            )


def _short(config) -> str:
    """(block_n, tiles, split_k, warps, stages, block_m[, extra_m])."""
    values = dataclasses.astuple(config)
    return "(" + ", ".join(str(int(v)) for v in (values if values[-1] else values[:-1])) + ")"


def table(records: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| N | K | M | bf16 us | int4 us | MXFP4 us | GB/s | % of 4.28 TB/s | vs bf16 | vs int4 | launch "
        "| decoded + cuBLAS us | vs bf16 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in records:
        us = r["default_us"]
        gbps = r["mx_bytes"] / us / 1e3
        best = f" (best {r['best_us']:.1f})" if r["best_us"] < 0.97 * us else ""
        dense = r.get("dense_us")
        dense_cells = f"{dense:.1f} | {r['bf16_us'] / dense:.2f}x" if dense else "- | -"
        lines.append(
            f"| {r['n']} | {r['k']} | {r['m']} | {r['bf16_us']:.1f} | {r['int4_us']:.1f} | {us:.1f}{best} | "
            f"{gbps:.0f} | {100 * gbps / (COPY_CEILING_TBPS * 1e3):.0f}% | {r['bf16_us'] / us:.2f}x | "
            f"{r['int4_us'] / us:.2f}x | {r['default']} | {dense_cells} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in LLAMA_8B_SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch configs, report the best")
    parser.add_argument("--sweep-ms", default="", help="sweep at these M only (comma list)")
    parser.add_argument("--two-tile", action="store_true", help="sweep programs with a second activation tile")
    parser.add_argument(
        "--profile",
        metavar="CONFIG",
        help="block_n,tiles,split_k,warps,stages[,block_m], default or bf16: 5 plain calls",
    )
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    ms = tuple(int(m) for m in args.ms.split(","))
    sweep = set(ms) if args.sweep else {int(m) for m in args.sweep_ms.split(",") if m}
    if args.profile:  # for ncu: no graphs, no checks
        config = None if args.profile in ("default", "bf16") else mm.MatmulConfig(*map(int, args.profile.split(",")))
        for n, k in shapes:
            w, _, _, weight = random_weight(n, k)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for _ in range(5):
                    if args.profile == "bf16":
                        F.linear(x, w)
                    else:
                        mm.mxfp4_matmul_triton(x, weight, config)
        torch.cuda.synchronize()
        return

    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {mm.triton.__version__}, commit {commit}, {now}")
    print(f"device copy: {copy_bandwidth_tbps():.2f} TB/s (read + write)")
    print(check_special_blocks(), flush=True)

    records: list[dict] = []
    for n, k in shapes:
        bench_shape(n, k, ms, sweep, records, args.two_tile)
    header = (
        f"MXFP4 matmul vs torch bf16 F.linear and int4 tinygemm, {device}, {now}, commit {commit}; "
        f"median per call in CUDA graphs, weights cycled past L2; `{' '.join(sys.argv)}`"
    )
    text = table(records, header)
    print(text)
    if os.environ.get("OUT"):
        name = "mxfp4_matmul_sweep" if args.sweep else "mxfp4_matmul"  # --sweep-ms: the table, best beside
        Path(os.environ["OUT"], f"{name}.md").write_text(text + "\n")
        Path(os.environ["OUT"], f"{name}.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
