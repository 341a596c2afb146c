"""`specchat quantize`: write an MXFP4 checkpoint of a model (GPTQ-calibrated or round-to-nearest).

    specchat quantize                                  # the default model, GPTQ, into the toggle's cache
    specchat quantize smollm2-135m --out q135 --method rtn --rule roundup
    specchat generate q135 -p "Hello"                  # loads the MXFP4 checkpoint directly

Without --out the checkpoint goes to the cache directory that the live toggle (`--weights mxfp4`, the UI's
switch) reads for this model, so the calibration runs once.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import click

from specchat.cli.options import StderrProgress
from specchat.config import DEVICES, DTYPES
from specchat.errors import ConfigError
from specchat.kernels.mxfp4 import RULES
from specchat.quant.gptq import CALIBRATION_TOKENS

METHODS = ("gptq", "rtn")


@click.command()
@click.argument("model", required=False)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="checkpoint directory (default: cache)")
@click.option("--method", type=click.Choice(METHODS), default="gptq", show_default=True)
@click.option("--rule", type=click.Choice(RULES), default="mse", show_default=True, help="block scale rule")
@click.option("--layers", default="blocks", show_default=True, help="linears to quantize (docs/quantization.md)")
@click.option("--rotate/--no-rotate", default=None, help="32-point block Hadamard rotation [default: on for gptq]")
@click.option("--act-order/--no-act-order", default=True, show_default=True, help="GPTQ: largest H diagonal first")
@click.option("--damp", type=float, default=0.01, show_default=True, help="GPTQ: dampening, x mean(diag H)")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="GPTQ calibration text (default: the one shipped in specchat/data/text)")  # fmt: skip
@click.option("--calibration-tokens", type=int, default=CALIBRATION_TOKENS, show_default=True, help="at most")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="of the dense tensors saved beside")
def quantize(
    model, out, method, rule, layers, rotate, act_order, damp, calibration, calibration_tokens, device, dtype
) -> None:
    """Quantize MODEL's linear layers to MXFP4 (OCP MX v1.0) and save a checkpoint `generate` can load."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.checkpoint import cache_dir, describe, is_mxfp4_checkpoint, save_mxfp4_checkpoint
    from specchat.quant.gptq import GptqSettings, calibrate, calibration_sequences, calibration_text
    from specchat.quant.handler import ROTATION, round_to_nearest, select_linears
    from specchat.registry import fetch, resolve, tokenizer_dir

    if calibration_tokens <= 0:
        raise ConfigError(f"--calibration-tokens must be > 0, got {calibration_tokens}")
    progress = StderrProgress()
    engine = Engine.load(EngineConfig(model=model or "smollm2-135m", device=device, dtype=dtype), progress=progress)
    spec = resolve(engine.config.model)
    source = fetch(spec)
    if is_mxfp4_checkpoint(source):
        raise ConfigError(f"{source} is already an MXFP4 checkpoint")
    try:
        names = select_linears(engine.model, layers)
    except ValueError as exc:
        raise ConfigError(f"--layers: {exc}") from None
    rotate = method == "gptq" if rotate is None else rotate  # rotation helps GPTQ, hurts RTN (benchmarks.md)
    started = time.perf_counter()
    meta = {"method": method, "rule": rule, "rotation": ROTATION if rotate else None, "layers": layers}
    meta |= {"source": spec.alias, "source_path": str(source)}
    if method == "rtn":
        packed = round_to_nearest(engine.model, names, rule, rotate)
    else:
        text = calibration.read_text() if calibration else calibration_text()
        sequences = calibration_sequences(engine.tokenizer.encode(text), calibration_tokens)
        settings = GptqSettings(rule=rule, damp=damp, act_order=act_order, rotate=rotate)
        packed = calibrate(engine.model, sequences, names, settings, progress=progress)
        meta["gptq"] = {"damp": damp, "act_order": act_order, "calibration_tokens": sum(len(s) for s in sequences)}
        meta["calibration"] = str(calibration) if calibration else "specchat/data/text/calibration_heapq.txt"
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    target = out or cache_dir(source)
    save_mxfp4_checkpoint(target, engine.model, packed, tokenizer_dir(spec, source), meta)
    where = "" if out else " (the cache the live MXFP4 toggle reads)"
    click.echo(f"{len(packed)} linears -> MXFP4 ({describe(meta)}) in {meta['seconds']} s: {target}{where}")


def register(group: click.Group) -> None:
    group.add_command(quantize)
