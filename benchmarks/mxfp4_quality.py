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
from specchat.kernels.mxfp4 import dequantize_mxfp4, mxfp4_nbytes, quantize_mxfp4
from specchat.quant.gptq import GptqSettings, calibrate, calibration_sequences, calibration_text
from specchat.quant.modules import fp4_modules, round_to_nearest, select_linears, swap_modules

TEXTS = {"heldout": HELD_OUT_TEXT, "prose": "heldout_langref.txt", "dev": "dev_queue.txt"}
FIRST_LAST_DOWN = "blocks,-layers.0.mlp.w_down,-layers.29.mlp.w_down"
FIRST_LAST_BLOCK = "blocks,-layers.0.*,-layers.29.*"
ALL_CALIBRATION_TOKENS = 1 << 20


@dataclass(frozen=True)
class Variant:
    method: str  # "bf16" | "rtn" | "gptq"
    rule: str = "mse"
    layers: str = "blocks"
    gptq: GptqSettings = field(default_factory=GptqSettings)
    embedding: bool = False  # also round the (tied) token embedding to MXFP4, values only
    rotate: bool = False  # quantize W R (R: 32-point block Hadamard), run by RotatedFp4Linear
    calibration_tokens: int = 2048  # the variants measured first; the default now takes the whole text
    derive: str | None = None  # reuse this variant's packed weights, restricted to `layers`


ACT = GptqSettings(act_order=True)
VARIANTS = {
    "bf16": Variant("bf16"),
    "rtn-ocp": Variant("rtn", "ocp"),
    "rtn-roundup": Variant("rtn", "roundup"),
    "rtn-mse": Variant("rtn", "mse"),
    "rtn-mse-rot": Variant("rtn", "mse", rotate=True),
    "rtn-mse+head": Variant("rtn", "mse", layers="all"),
    "rtn-mse+head+embed": Variant("rtn", "mse", layers="all", embedding=True),
    "gptq-act+head": Variant("gptq", "mse", layers="all", gptq=ACT),
    "gptq-act": Variant("gptq", derive="gptq-act+head"),
    "gptq-act-keep-down0+29": Variant("gptq", layers=FIRST_LAST_DOWN, derive="gptq-act+head"),
    "gptq-act-keep-block0+29": Variant("gptq", layers=FIRST_LAST_BLOCK, derive="gptq-act+head"),
    "gptq": Variant("gptq", "mse"),
    "gptq-act-rot": Variant("gptq", "mse", gptq=GptqSettings(act_order=True, rotate=True), rotate=True),
    "gptq-act-damp0.1": Variant("gptq", "mse", gptq=GptqSettings(damp=0.1, act_order=True)),
    "gptq-act-calib-all": Variant("gptq", "mse", gptq=ACT, calibration_tokens=ALL_CALIBRATION_TOKENS),
    "gptq-act-ocp": Variant("gptq", "ocp", gptq=ACT),
    "gptq-act-calib-all-keep-down0+29": Variant("gptq", layers=FIRST_LAST_DOWN, derive="gptq-act-calib-all"),
    "gptq-act-rot-calib-all": Variant(
        "gptq", gptq=GptqSettings(act_order=True, rotate=True), rotate=True, calibration_tokens=ALL_CALIBRATION_TOKENS
    ),
}


def packed_weights(engine: Engine, variant: Variant, calib_ids: list[int], done: dict[str, dict]) -> dict:
    model = engine.model
    names = select_linears(model, variant.layers)
    if variant.derive:
        return {name: done[variant.derive][name] for name in names}
    if variant.method == "rtn":
        return round_to_nearest(model, names, variant.rule, variant.rotate)
    settings = GptqSettings(variant.rule, variant.gptq.damp, variant.gptq.act_order, variant.gptq.rotate)
    return calibrate(model, calibration_sequences(calib_ids, variant.calibration_tokens), names, settings)


def block_linear_bytes(model: torch.nn.Module, packed: dict) -> int:
    """Bytes of the transformer blocks' linear weights: MXFP4 where quantized, bf16 elsewhere."""
    total = 0
    for name in select_linears(model, "blocks"):
        shape = model.get_submodule(name).weight.shape
        total += mxfp4_nbytes(shape) if name in packed else shape.numel() * 2
    return total


def run_variant(engine: Engine, variant: Variant, texts: dict, calib_ids: list[int], done: dict, args) -> dict:
    """Quantize as `variant` says, measure perplexity on each text, undo the swap."""
    t0 = time.perf_counter()
    model = engine.model
    packed = {} if variant.method == "bf16" else packed_weights(engine, variant, calib_ids, done)
    quant_s = time.perf_counter() - t0
    size = block_linear_bytes(model, packed)
    original = swap_modules(model, fp4_modules(model, packed, rotated=variant.rotate))
    embed = model.embed.weight.data
    if variant.embedding:
        codes, scales = quantize_mxfp4(embed, rule=variant.rule)
        model.embed.weight.data = dequantize_mxfp4(codes, scales, embed.dtype, k=embed.shape[1])
    try:
        ppl = {name: perplexity(engine, ids, args.context, args.stride).ppl for name, ids in texts.items()}
    finally:
        model.embed.weight.data = embed
        swap_modules(model, original)
    return {"packed": packed, "ppl": ppl, "quantize_s": quant_s, "layers": len(packed), "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="heldout,dev", help="comma list of heldout | prose | dev | file paths")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    parser.add_argument("--stride", type=int, default=DEFAULT_STRIDE)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, help="torch threads (1 is fastest on a shared, loaded CPU)")
    parser.add_argument("--json-out", type=Path, help="append one JSON line per variant here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    texts = {}
    for name in args.texts.split(","):
        path = resources.files("specchat").joinpath("data", "text", TEXTS[name]) if name in TEXTS else Path(name)
        texts[name] = engine.tokenizer.encode(path.read_text())
    calib_ids = engine.tokenizer.encode(calibration_text())
    header = ["variant", *(f"{t} ppl ({len(ids)} tokens) | vs bf16" for t, ids in texts.items())]
    header += ["MXFP4 linears", "block linears MB", "quantize s"]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * (len(header) + len(texts)))
    done: dict[str, dict] = {}
    baseline: dict[str, float] = {}
    for name in args.variants.split(","):
        row = run_variant(engine, VARIANTS[name], texts, calib_ids, done, args)
        done[name] = row.pop("packed")
        if name == "bf16":
            baseline = row["ppl"]
        cells = [name]
        for text, ppl in row["ppl"].items():
            delta = f"{100 * (ppl / baseline[text] - 1):+.1f}%" if baseline else "-"
            cells += [f"{ppl:.3f}", delta]
        cells += [row["layers"], f"{row['bytes'] / 1e6:.1f}", f"{row['quantize_s']:.0f}"]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        if args.json_out:
            with args.json_out.open("a") as f:
                f.write(json.dumps({"variant": name, **row}) + "\n")


if __name__ == "__main__":
    main()
