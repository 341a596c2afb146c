"""`specchat quantize`: write an MXFP4 checkpoint of a model (GPTQ-calibrated or round-to-nearest).

    specchat quantize                                  # the default model, GPTQ, into the toggle's cache
    specchat quantize smollm2-135m --out q135 --method rtn --rule roundup
    specchat generate q135 -p "Hello"                  # loads the MXFP4 checkpoint directly

Without --out the checkpoint goes to the cache directory that the live toggle (`--weights mxfp4`, the UI's
switch) reads for this model, so the calibration runs once.
"""

from __future__ import annotations

from pathlib import Path

import click

from specchat.cli.inputs import given_path, read_nonempty_text
from specchat.cli.options import StderrProgress, given_flags, model_argument
from specchat.config import (
    CALIBRATION_TOKENS,
    DEFAULT_DAMP,
    DEFAULT_QUANT_LAYERS,
    DEFAULT_QUANT_METHOD,
    DEFAULT_QUANT_RULE,
    DEVICES,
    DTYPES,
    MXFP4_RULES,
    QUANT_METHODS,
)
from specchat.errors import ConfigError
from specchat.registry import default_model

GPTQ_ONLY = ("act_order", "damp", "calibration", "calibration_tokens")  # refused with --method rtn, not ignored


def check_layers_text(layers: str) -> None:
    """A --layers that names no term ("", ",") selects nothing: refused before the model loads."""
    if not any(term.strip().removeprefix("-").strip() for term in layers.split(",")):
        raise ConfigError(
            f"--layers {layers!r} names no linears: give a comma list such as all, blocks, lm_head or a pattern "
            "(docs/quantization.md)"
        )


def check_layers_select(model, layers: str) -> None:
    """--layers must choose at least one linear of the loaded model: a selection whose terms remove all they add
    ("blocks,-blocks") wrote a checkpoint of 0 MXFP4 linears and exited 0."""
    from specchat.quant.modules import select_linears

    try:
        chosen = select_linears(model, layers)
    except ValueError as exc:
        raise ConfigError(f"--layers: {exc}") from None
    if not chosen:
        raise ConfigError(f"--layers {layers!r} selects no linear module (its terms remove what they add)")


@click.command()
@model_argument
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="checkpoint folder to make (default: the cache the live MXFP4 toggle reads)",
)
@click.option(
    "--method",
    type=click.Choice(QUANT_METHODS),
    default=DEFAULT_QUANT_METHOD,
    show_default=True,
    help="gptq: calibrated on a text (minutes on a CPU); rtn: round to nearest (seconds)",
)
@click.option(
    "--rule", type=click.Choice(MXFP4_RULES), default=DEFAULT_QUANT_RULE, show_default=True, help="block scale rule"
)
@click.option(
    "--layers", default=DEFAULT_QUANT_LAYERS, show_default=True, help="linears to quantize (docs/quantization.md)"
)
@click.option("--rotate/--no-rotate", default=None, help="32-point block Hadamard rotation [default: on for gptq]")
@click.option("--act-order/--no-act-order", default=True, show_default=True, help="GPTQ: largest H diagonal first")
@click.option("--damp", type=float, default=DEFAULT_DAMP, show_default=True, help="GPTQ: dampening, x mean(diag H)")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="GPTQ calibration text (default: the one shipped in specchat/data/text)")  # fmt: skip
@click.option(
    "--calibration-tokens",
    type=int,
    default=CALIBRATION_TOKENS,
    show_default=True,
    help="GPTQ: calibrate on at most this many tokens of the text",
)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True, help="where to quantize")
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default=None,
    help="of the tensors kept dense (embedding, norms, linears not chosen) [default: as the model loads]",
)
def quantize(
    model, out, method, rule, layers, rotate, act_order, damp, calibration, calibration_tokens, device, dtype
) -> None:
    """Quantize the linears of MODEL (default: smollm2-135m) to MXFP4 (OCP MX v1.0): a checkpoint `generate` loads."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.quantize import QuantizeSettings, check_out_dir, quantize_to_checkpoint
    from specchat.registry import fetch, resolve, tokenizer_dir

    if method == "rtn" and (gptq_flags := given_flags(click.get_current_context(), GPTQ_ONLY)):
        raise click.UsageError(f"{', '.join(gptq_flags)}: for --method gptq, not --method rtn")
    if out is not None:
        out = given_path(out, "--out", "leave it out for the cache, or name a folder")
    check_layers_text(layers)
    if calibration is not None:
        read_nonempty_text(calibration, "--calibration")  # an empty or unreadable text fails before the model loads
    if out is not None:
        check_out_dir(out)  # a folder of other files (the model's own) or one that cannot be made: before loading
    settings = QuantizeSettings(
        method=method,
        rule=rule,
        layers=layers,
        rotate=rotate,
        act_order=act_order,
        damp=damp,
        calibration=calibration,
        calibration_tokens=calibration_tokens,
    )
    progress = StderrProgress()
    engine = Engine.load(EngineConfig(model=model or default_model(), device=device, dtype=dtype), progress=progress)
    check_layers_select(engine.model, layers)
    spec = resolve(engine.config.model)
    source = fetch(spec)
    result = quantize_to_checkpoint(
        engine.model, engine.tokenizer.encode, settings, source, spec.alias, tokenizer_dir(spec, source), out, progress
    )
    how = result.method + (f", {result.calibration_tokens} calibration tokens" if result.calibration_tokens else "")
    if result.reused:  # nothing ran: say so, rather than print the earlier run's time as this one's
        click.echo(
            f"{result.linears} linears -> MXFP4 ({how}): already in the cache the live MXFP4 toggle reads, made "
            f"with the same settings in {result.seconds} s: {result.path}"
        )
        return
    where = "" if out else " (the cache the live MXFP4 toggle reads)"
    click.echo(f"{result.linears} linears -> MXFP4 ({how}) in {result.seconds} s: {result.path}{where}")


def register(group: click.Group) -> None:
    group.add_command(quantize)
