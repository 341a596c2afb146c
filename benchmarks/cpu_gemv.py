"""The CPU block kernels (kernels/cpu_gemv.py) on the default model's shapes: this tree against a git revision,
and beside them the int8-activation kernels (kernels/cpu_gemv_i8.py) where the CPU has AVX512-VNNI.

    python benchmarks/cpu_gemv.py [--baseline REV] [--threads 1] [--rows 1 5] [--repeats 30]

Both C sources (the baseline's as the module built it at REV: benchmarks/base_source.py) are compiled with the same
flags and called through ctypes with the same random Q4_1 / Q8_0 blocks, calls interleaved; the two outputs are
compared (max abs difference) on each shape. Shapes of SmolLM2-135M: fused wqkv 960x576, wo 576x576, fused
gate_up 3072x576, down 576x1536 (Q4_1, 30 layers each), the tied head 49152x576 (Q8_0). Prints a markdown table
of the median time per call and the per-token total (30 layers + head) with its weight bytes per second.
The int8 columns time cpu_gemv_i8's call on the same blocks (repacked; the activation rows' quantization
included), the baseline's C source and this tree's, interleaved with the others; the error column is the relative
Frobenius distance of this tree's int8 result to the float one (the two int8 builds must agree bit for bit).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from specchat.kernels import cpu_build, cpu_gemv, cpu_gemv_i8

sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.base_source import module_source, tree_at

SHAPES = [  # name, N, K, kind, times per token
    ("wqkv", 960, 576, "q4_1", 30),
    ("wo", 576, 576, "q4_1", 30),
    ("gate_up", 3072, 576, "q4_1", 30),
    ("down", 576, 1536, "q4_1", 30),
    ("head", 49152, 576, "q8_0", 1),
]


def load(source: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    openmp = cpu_build.torch_openmp()
    cmd = ["cc", "-fopenmp", *cpu_gemv.CFLAGS, str(src), "-o", str(out)]
    if openmp is not None:
        cmd += [str(openmp), f"-Wl,-rpath,{openmp.parent}"]
    subprocess.run(cmd, check=True)
    return ctypes.CDLL(str(out))


def weights(n: int, k: int, kind: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n + k)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # GGUF's scales are float16
    if kind == "q4_1":
        return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, -d * 8
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), d


def call(lib: ctypes.CDLL, x: torch.Tensor, w: tuple[torch.Tensor, ...], y: torch.Tensor, threads: int) -> None:
    m, k = x.shape
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (x, *w, y)]
    fn = lib.q4_gemm if len(w) == 3 else lib.q8_gemm
    fn(m, y.shape[1], k, *ptrs, threads)


def nbytes(w: tuple[torch.Tensor, ...]) -> int:
    """Bytes as the GGUF stores them: codes + fp16 scales."""
    return w[0].numel() + sum(t.numel() * 2 for t in w[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="HEAD")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = tree_at(args.baseline, Path(tmp) / "base")
        base_src = module_source(base_tree, "cpu_gemv")
        libs = {
            "baseline": load(base_src, Path(tmp) / "base.so"),
            "this tree": load(cpu_gemv.C_SOURCE, Path(tmp) / "new.so"),
        }
        with open("/proc/loadavg") as f:
            loadavg = f.read().split()[:3]
        print(
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
            f"threads {args.threads}, baseline {args.baseline} ({commit.strip()}), load average {' '.join(loadavg)}\n"
        )
        int8 = cpu_gemv_i8.available()
        i8_libs = {}  # the baseline's int8 build (where it has one), then this tree's
        if int8:
            base_i8 = cpu_gemv_i8.bind(load(module_source(base_tree, "cpu_gemv_i8"), Path(tmp) / "base_i8.so"))
            i8_libs = {"int8 baseline": base_i8} if base_i8 else {}
            i8_libs["int8"] = cpu_gemv_i8._library()
        names = [*libs, *i8_libs]
        print(
            "| shape | N x K | kind | rows | baseline (us) | this tree (us) | speedup | max abs diff "
            "| int8 act, baseline (us) | int8 act (us) | speedup | vs float | int8 rel. error |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        totals = {(r, name): 0.0 for r in args.rows for name in names}
        token_bytes = 0
        for label, n, k, kind, count in SHAPES:
            w = weights(n, k, kind)
            bound = cpu_gemv_i8.Bound(*w) if int8 else None
            token_bytes += nbytes(w) * count
            for rows in args.rows:
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                ys = {name: torch.empty(rows, n) for name in names}
                times = {name: [] for name in names}
                for _ in range(args.repeats):
                    for name, lib in libs.items():
                        t0 = time.perf_counter()
                        call(lib, x, w, ys[name], args.threads)
                        times[name].append(time.perf_counter() - t0)
                    # the int8 C call alone, as for the others (the engine calls it from C)
                    for name, lib in i8_libs.items():
                        ptrs = [t.data_ptr() for t in bound.tensors] + [None] * (3 - len(bound.tensors))
                        t0 = time.perf_counter()
                        lib.i8_gemm(rows, n, k, x.data_ptr(), *ptrs, ys[name].data_ptr(), args.threads)
                        times[name].append(time.perf_counter() - t0)
                med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
                for name in names:
                    totals[(rows, name)] += med[name] * count
                diff = (ys["baseline"] - ys["this tree"]).abs().max().item()
                line = (
                    f"| {label} | {n} x {k} | {kind} | {rows} | {med['baseline']:.1f} | {med['this tree']:.1f} "
                    f"| {med['baseline'] / med['this tree']:.2f}x | {diff:.1e} |"
                )
                if int8:
                    assert "int8 baseline" not in ys or torch.equal(ys["int8 baseline"], ys["int8"]), label
                    i8_base = med.get("int8 baseline")
                    i8_speedup = f"{i8_base / med['int8']:.2f}x" if i8_base else "-"
                    error = ((ys["int8"] - ys["this tree"]).norm() / ys["this tree"].norm()).item()
                    line += (
                        f" {f'{i8_base:.1f}' if i8_base else '-'} | {med['int8']:.1f} "
                        f"| {i8_speedup} "
                        f"| {med['this tree'] / med['int8']:.2f}x | {error:.1e} |"
                    )
                print(line + ("" if int8 else " | | | | |"))
        print()
        print(
            "| rows | per token, baseline (ms) | this tree (ms) | speedup | weight GB/s, baseline | this tree "
            "| int8 act, baseline (ms) | int8 act (ms) | vs float |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for rows in args.rows:
            b, t = totals[(rows, "baseline")] / 1e3, totals[(rows, "this tree")] / 1e3
            line = f"| {rows} | {b:.2f} | {t:.2f} | {b / t:.2f}x | {token_bytes / b / 1e6:.1f} | {token_bytes / t / 1e6:.1f} |"
            if int8:
                i = totals[(rows, "int8")] / 1e3
                i_base = totals.get((rows, "int8 baseline"))
                line += f" {f'{i_base / 1e3:.2f}' if i_base else '-'} | {i:.2f} | {t / i:.2f}x |"
            print(line + ("" if int8 else " | | |"))


if __name__ == "__main__":
    main()
