"""The dense GEMV (kernels/dense_gemv_triton.py) against cuBLAS (F.linear) per linear, on a small model's shapes
(CUDA).

    python benchmarks/dense_gemv.py [--shape smollm2-135m] [--ms 1,4,16] [--sweep]

Each case is timed as mxfp4_matmul.py times its matmuls: 20 calls in a CUDA graph, cycling through copies of the
weight that together pass the L2 (a small model's weights come from DRAM in a step too: 270 MB for the default
model). The GEMV is timed with PDL off and on (on: consecutive calls in the graph are programmatic edges, as in a
step where every kernel is ours; each prefetches its weights while the one before runs). --sweep also times launch
configurations around `choose_config` and prints the best per shape and M beside it.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from mxfp4_matmul import L2_DEFEAT_BYTES, graph_time_us

from specchat.bench.synthetic import SHAPES
from specchat.kernels import pdl
from specchat.kernels.dense_gemv import GemvConfig, choose_config
from specchat.kernels.dense_gemv_triton import dense_gemv

SWEEP = [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (2, 4), (2, 3))]


def shapes(name: str) -> list[tuple[str, int, int, bool]]:
    """(linear, N, K, gated) of one layer and the output head."""
    c = SHAPES[name]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [
        ("wqkv", qkv, c.hidden_size, False),
        ("wo", c.hidden_size, c.num_heads * c.head_dim, False),
        ("gate_up (gated)", 2 * c.intermediate_size, c.hidden_size, True),
        ("w_down", c.hidden_size, c.intermediate_size, False),
        ("lm_head", c.vocab_size, c.hidden_size, False),
    ]


def time_case(m: int, n: int, k: int, gated: bool, config: GemvConfig | None, pdl_on: bool | None) -> float:
    """us per call: cuBLAS where pdl_on is None (gate_up then unfused: F.linear), else the GEMV."""
    copies = max(1, -(-L2_DEFEAT_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if pdl_on is None:
        calls = [lambda w=w: F.linear(x, w) for w in weights]
    else:
        calls = [lambda w=w: dense_gemv(x, w, gated=gated, config=config) for w in weights]
    with pdl.override(pdl_on):
        return graph_time_us(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    print(f"{args.shape}, {torch.cuda.get_device_name()}: us per call in CUDA graphs, weights cycled past the L2")
    print(
        "| linear | N x K | M | cuBLAS | GEMV | GEMV, PDL | GEMV vs cuBLAS | with PDL |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for (name, n, k, gated), m in itertools.product(shapes(args.shape), ms):
        base = time_case(m, n, k, gated, None, None)
        plain = time_case(m, n, k, gated, None, False)
        chained = time_case(m, n, k, gated, None, True)
        print(f"| {name} | {n} x {k} | {m} | {base:.2f} | {plain:.2f} | {chained:.2f} | {base / plain:.2f}x | "
              f"{base / chained:.2f}x |", flush=True)  # fmt: skip
    if not args.sweep:
        return
    print("\nBest launches (PDL on) against choose_config's:")
    for (name, n, k, gated), m in itertools.product(shapes(args.shape), ms):
        chosen = choose_config(n // 2 if gated else n, k, gated, m)
        timed = sorted(((time_case(m, n, k, gated, c, True), c) for c in SWEEP), key=lambda pair: pair[0])
        own = time_case(m, n, k, gated, chosen, True)
        best = ", ".join(f"{t:.2f} us {c}" for t, c in timed[:3])
        print(f"{name} {n} x {k}, M = {m}: chosen {own:.2f} us {chosen}; best {best}", flush=True)


if __name__ == "__main__":
    main()
