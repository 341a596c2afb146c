"""The CPU KV quantizer (kernels/cpu_attention.py's store into k8v4 / mxfp4 pages): us per call of quantize_rows.

    python benchmarks/cpu_kv_quantize.py [--rows 756] [--march haswell]

One call quantizes --rows rows of head_dim 64 (756: a 252-token prompt's keys or values over the default model's 3
KV heads) as MXFP8 and as MXFP4 under the "mse" and "ocp" scale rules, as they are and after the pages' Hadamard
rotation; median of --repeats calls. Every call's bytes are checked against kv_quant.quantize_rows first.
`--march` builds the kernels for another -march (e.g. haswell: the AVX2 build) into a separate cache folder, to
time that build on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=756)
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--march", default="", help="compile for this -march instead of native")
    args = ap.parse_args()
    from specchat.kernels import cpu_ops

    if args.march:  # a build of its own, not the native one the cache holds
        os.environ["SPECCHAT_HOME"] = tempfile.mkdtemp(prefix=f"specchat-{args.march}-")
        cpu_ops.CFLAGS = tuple(f if f != "-march=native" else f"-march={args.march}" for f in cpu_ops.CFLAGS)
    from specchat.engine.kv_pages import rotation_matrix
    from specchat.kernels import cpu_attention, kv_quant

    x = torch.randn(args.rows, 64, generator=torch.Generator().manual_seed(0)) * 3
    scale = float(rotation_matrix(64)[0, 0])
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, -march={args.march or 'native'}"
    )
    print("| format | rule | rows | us per call | us, Hadamard-rotated |")
    print("|---|---|---:|---:|---:|")
    for fmt, rule in (("mxfp8", "mse"), ("mxfp4", "mse"), ("mxfp4", "ocp")):
        cells = []
        for block in (0, 64):
            got = cpu_attention.quantize_rows(x, fmt, rule, hadamard=block, scale=scale)
            rotated = cpu_attention.hadamard_rows_ref(x, block, scale)
            want = kv_quant.quantize_rows(rotated, fmt, rule)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (fmt, rule, block)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                cpu_attention.quantize_rows(x, fmt, rule, hadamard=block, scale=scale)
                times.append((time.perf_counter() - t0) * 1e6)
            cells.append(f"{statistics.median(times):.1f}")
        print(f"| {fmt} | {rule} | {args.rows} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
