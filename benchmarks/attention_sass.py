"""What the paged-attention kernel compiles to, without a GPU: SASS instructions per key of its main loop.

    python benchmarks/attention_sass.py [--pages mxfp4|k8v4|bf16] [--query-rows] [--block-n 128] [--warps 4]
        [--stages 2] [--arch 90] [--decode e4m3|bits] [--lines] [--out DIR]

Triton compiles the kernel for the target (`triton.compile` needs no device; its wheel carries ptxas, cuobjdump
and nvdisasm) at the Llama-3.1-8B decode shape the H200 benchmarks use (4 query heads per KV head, head_dim 128,
pages of 16, bf16 queries), with the integer arguments specialised as a launch would (strides divisible by 16,
the quantized pages' one-word scale stride equal to 1). It prints the registers per thread, and the instructions
of the main loop (the widest backward branch): per warp and iteration, and per key over the program's warps, the
issue budget a warp scheduler spends per key. At the H200's 4.28 TB/s an SM must take in ~16 bytes a cycle, so
MXFP4 pages (136 bytes a key, keys + values) leave ~33 warp instructions per key at full issue rate.
--lines adds the count per source line (nvdisasm's line info); --out keeps the TTGIR, PTX, cubin and SASS.
To match the H200's compiler, put that Triton version first on PYTHONPATH (pip install --target DIR triton==3.6.0).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specchat.kernels import attention_triton

FORMATS = {"bf16": (0, 0), "mxfp4": (1, 1), "k8v4": (2, 1)}  # key format, value format (attention_triton._FMT_IDS)
DIVISIBLE = ("stride_qt", "stride_qh", "stride_kh", "stride_ks", "stride_ksh", "stride_vh", "stride_vs")
DIVISIBLE += ("stride_vsh", "stride_tb", "stride_ot", "stride_oh", "stride_op")
_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);")


def compile_kernel(args: argparse.Namespace) -> triton.compiler.CompiledKernel:
    fn = attention_triton._paged_attention_kernel
    k_fmt, v_fmt = FORMATS[args.pages]
    quantized = k_fmt != 0
    const = dict(
        K_FMT=k_fmt, V_FMT=v_fmt, DOT_DTYPE=tl.float16 if quantized else tl.bfloat16, PRECISION="tf32", GROUP=4,
        HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=args.block_n, SB=4, PDL=False, OFFSETS=tl.int32,
        KEY_ROWS=not args.query_rows,
        DECODE=attention_triton.DECODE_E4M3 if args.decode == "e4m3" else attention_triton.DECODE_BITS,
    )  # fmt: skip
    if quantized:  # one int32 word of scales per row: a stride of 1, which a launch specialises as a constant
        const.update(stride_kss=1, stride_vss=1)
    signature = {}
    for name in fn.arg_names:
        if name in const:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            data = name in ("k_ptr", "k_scale_ptr", "v_ptr", "v_scale_ptr")
            signature[name] = ("*i32" if quantized else "*bf16") if data else "*fp32" if "part" in name else "*i32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    signature["q_ptr"] = "*bf16"
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n in DIVISIBLE or (not quantized and "ss" in n)]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n not in const}
    constexprs = {(fn.arg_names.index(n),): v for n, v in const.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=args.warps, num_stages=args.stages)
    return triton.compile(source, target=GPUTarget("cuda", args.arch, 32), options=options)


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def main_loop(sass: str) -> tuple[int, int]:
    """Address range of the loop closed by the widest backward branch."""
    spans = [
        (int(target, 16), int(at, 16))
        for at, op, rest in _OP.findall(sass)
        if op == "BRA" and (target := rest.strip().split()[-1]).startswith("0x") and int(target, 16) < int(at, 16)
    ]
    return max(spans, key=lambda span: span[1] - span[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", choices=sorted(FORMATS), default="mxfp4")
    parser.add_argument("--query-rows", action="store_true", help="the query rows as the MMA's rows")
    parser.add_argument("--block-n", type=int, default=attention_triton.QUANT_BLOCK_N)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=attention_triton.QUANT_NUM_STAGES)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--decode", choices=("e4m3", "bits"), default="e4m3")
    parser.add_argument("--lines", action="store_true")
    parser.add_argument("--out", help="keep the TTGIR, PTX, cubin and SASS here")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="attention_sass_")
    os.makedirs(out, exist_ok=True)
    kernel = compile_kernel(args)
    for key in ("ttgir", "ptx"):
        with open(os.path.join(out, f"kernel.{key}"), "w") as f:
            f.write(kernel.asm[key])
    cubin = os.path.join(out, "kernel.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out, "kernel.sass"), "w") as f:
        f.write(sass)
    usage = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True).stdout
    registers = " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))
    lo, hi = main_loop(sass)
    loop = collections.Counter(op for at, op, _ in _OP.findall(sass) if lo <= int(at, 16) <= hi)
    total = sum(loop.values())
    print(
        f"triton {triton.__version__}, sm_{args.arch}, {args.pages} pages, "
        f"{'query' if args.query_rows else 'key'} rows, {args.block_n}-key tiles, {args.warps} warps, "
        f"{args.stages} stages, {args.decode} decode: {registers}"
    )
    print(
        f"main loop: {total} instructions per warp and iteration, "
        f"{total * args.warps / args.block_n:.1f} warp instructions per key"
    )
    print("  " + ", ".join(f"{op} {n}" for op, n in loop.most_common(16)))
    if args.lines:
        listing = subprocess.run([tool("nvdisasm"), "-c", "-gi", cubin], capture_output=True, text=True).stdout
        where, per_line = None, collections.Counter()
        for line in listing.splitlines():
            if m := re.search(r'//## File "([^"]+)", line (\d+)', line):
                where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            elif (m := _OP.search(line)) and lo <= int(m.group(1), 16) <= hi:
                per_line[where] += 1
        for where, n in per_line.most_common(20):
            print(f"  {n:5d}  {where}")
    print(f"files: {out}")


if __name__ == "__main__":
    main()
