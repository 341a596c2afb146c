"""MXFP4 weight quality on the default model: perplexity of every quantization variant, one run, one table.

    python benchmarks/mxfp4_quality.py                       # all variants on the held-out text
    python benchmarks/mxfp4_quality.py --text dev --variants rtn-mse,gptq

Baseline: the model as loaded (the default model's GGUF weights dequantized, float32 on the CPU). Each variant
swaps MXFP4 `Fp4Linear` modules into the engine's model (specchat.quant.handler) and measures perplexity with
`specchat perplexity`'s sliding window, through the engine's model and KV pool; the swap is undone before the
next variant. Defaults are chosen on the development text (`--text dev`), never on the held-out one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from specchat.cli.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE, HELD_OUT_TEXT, perplexity
from specchat.config import EngineConfig
from specchat.engine.engine import Engine
from specchat.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from specchat.quant.gptq import GptqSettings, calibrate, calibration_sequences, calibration_text
from specchat.quant.handler import fp4_modules, round_to_nearest, select_linears, swap_modules

TEXTS = {"heldout": HELD_OUT_TEXT, "dev": "dev_queue.txt"}
FIRST_LAST_DOWN = "blocks,-layers.0.mlp.w_down,-layers.29.mlp.w_down"


@dataclass(frozen=True)
class Variant:
    method: str  # "bf16" | "rtn" | "gptq"
    rule: str = "mse"
    layers: str = "blocks"
    gptq: GptqSettings = field(default_factory=GptqSettings)
    embedding: bool = False  # also round the (tied) token embedding to MXFP4, values only
    note: str = ""


VARIANTS = {
    "bf16": Variant("bf16", note="baseline: the GGUF weights dequantized"),
    "rtn-ocp": Variant("rtn", "ocp"),
    "rtn-roundup": Variant("rtn", "roundup"),
    "rtn-mse": Variant("rtn", "mse"),
    "gptq-ocp": Variant("gptq", "ocp"),
    "gptq": Variant("gptq", "mse"),
    "gptq-act": Variant("gptq", "mse", gptq=GptqSettings(act_order=True)),
    "gptq-damp0.1": Variant("gptq", "mse", gptq=GptqSettings(damp=0.1)),
    "gptq-keep-down0+29": Variant("gptq", "mse", layers=FIRST_LAST_DOWN),
    "rtn-mse+head": Variant("rtn", "mse", layers="all"),
    "gptq+head": Variant("gptq", "mse", layers="all"),
    "rtn-mse+head+embed": Variant("rtn", "mse", layers="all", embedding=True),
}


def packed_weights(engine: Engine, variant: Variant, calib: list[torch.Tensor]) -> dict:
    names = select_linears(engine.model, variant.layers)
    if variant.method == "rtn":
        return round_to_nearest(engine.model, names, variant.rule)
    settings = GptqSettings(variant.rule, variant.gptq.damp, variant.gptq.act_order)
    return calibrate(engine.model, calib, names, settings)


def run_variant(engine: Engine, variant: Variant, ids: list[int], calib, args) -> dict:
    t0 = time.perf_counter()
    model = engine.model
    packed = {} if variant.method == "bf16" else packed_weights(engine, variant, calib)
    quant_s = time.perf_counter() - t0
    original = swap_modules(model, fp4_modules(model, packed))
    embed = model.embed.weight.data
    if variant.embedding:
        codes, scales = quantize_mxfp4(embed, rule=variant.rule)
        model.embed.weight.data = dequantize_mxfp4(codes, scales, embed.dtype, k=embed.shape[1])
    try:
        result = perplexity(engine, ids, args.context, args.stride)
    finally:
        model.embed.weight.data = embed
        swap_modules(model, original)
    return {"ppl": result.ppl, "tokens": result.tokens, "quantize_s": quant_s, "layers": len(packed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="heldout", help="heldout | dev | a file path")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    parser.add_argument("--stride", type=int, default=DEFAULT_STRIDE)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json-out", type=Path, help="append one JSON line per variant here")
    args = parser.parse_args()

    engine = Engine.load(EngineConfig(device="cpu", dtype=args.dtype))
    if args.text in TEXTS:
        text = resources.files("specchat").joinpath("data", "text", TEXTS[args.text]).read_text()
    else:
        text = Path(args.text).read_text()
    ids = engine.tokenizer.encode(text)
    calib = calibration_sequences(engine.tokenizer.encode(calibration_text()))
    baseline = None
    print(f"| variant | perplexity | vs bf16 | layers | quantize s |  ({args.text}, {len(ids)} tokens)")
    print("| --- | --- | --- | --- | --- |")
    for name in args.variants.split(","):
        row = run_variant(engine, VARIANTS[name], ids, calib, args)
        baseline = baseline or (row["ppl"] if name == "bf16" else None)
        delta = f"{100 * (row['ppl'] / baseline - 1):+.1f}%" if baseline else "-"
        print(f"| {name} | {row['ppl']:.3f} | {delta} | {row['layers']} | {row['quantize_s']:.0f} |", flush=True)
        if args.json_out:
            with args.json_out.open("a") as f:
                f.write(json.dumps({"variant": name, "text": args.text, **row}) + "\n")


if __name__ == "__main__":
    main()
