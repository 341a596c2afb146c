"""`specchat quantize` as one call: a loaded model's linears -> MXFP4 (GPTQ or round to nearest) -> a checkpoint.

The command line (cli/quantize.py) loads the model through the engine, fills a `QuantizeSettings` from its
flags and calls `quantize_to_checkpoint`; the names its flags offer (methods, rounding rules) and their defaults
are the ones here. The live toggle (quant.handler) calls it with the defaults to fill its cache. The checkpoint
format is quant.checkpoint's; GPTQ is quant.gptq's, round to nearest quant.modules'.

The cache (`out=None`) holds one checkpoint per model file, reused as it is when it was made with the same
settings. A checkpoint, there or in `out`, is written whole under a temporary name beside it and renamed, so a run
cut short leaves nothing half-written; an `out` that holds anything but an MXFP4 checkpoint (the source model's own
folder, say) is refused before anything is quantized.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from specchat.config import (
    CALIBRATION_TOKENS,
    DEFAULT_DAMP,
    DEFAULT_QUANT_LAYERS,
    DEFAULT_QUANT_METHOD,
    DEFAULT_QUANT_RULE,
    QUANT_METHODS,
)
from specchat.errors import ConfigError
from specchat.kernels.mxfp4 import RULES, Rule
from specchat.quant.checkpoint import (
    METADATA_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    Packed,
    cache_dir,
    describe,
    is_mxfp4_checkpoint,
    read_metadata,
    save_mxfp4_checkpoint,
)
from specchat.quant.gptq import (
    CALIBRATION_TEXT,
    GptqSettings,
    calibrate,
    calibration_sequences,
    calibration_text,
)
from specchat.quant.modules import ROTATION, round_to_nearest, select_linears
from specchat.writes import check_writable_folder, write_folder_whole

Progress = Callable[[str, int, int], None]  # (what, done, total)
CHECKPOINT_FILES = {WEIGHTS_FILE, METADATA_FILE, "config.json", *TOKENIZER_FILES}  # what a checkpoint folder holds
# GPTQ adds damp x mean(diag H) to H's diagonal: past 1000 the off-diagonal terms that GPTQ compensates through are
# under 0.1% of it (round to nearest, slower), and far past it the sum overflows and the Cholesky factor fails.
MAX_DAMP = 1000.0


@dataclass(slots=True)
class QuantizeSettings:
    """How `specchat quantize` makes a model's MXFP4 weights (one field per flag; see docs/quantization.md)."""

    method: str = DEFAULT_QUANT_METHOD
    rule: Rule = DEFAULT_QUANT_RULE  # block scale rule (kernels.mxfp4)
    layers: str = DEFAULT_QUANT_LAYERS  # layer selection (quant.modules)
    rotate: bool | None = None  # 32-point block Hadamard rotation; None: on for GPTQ, off for RTN
    act_order: bool = True  # GPTQ: largest H diagonal first
    damp: float = DEFAULT_DAMP  # GPTQ: dampening, x mean(diag H)
    calibration: Path | None = None  # GPTQ calibration text; None: the one shipped in specchat/data/text
    calibration_tokens: int = CALIBRATION_TOKENS  # GPTQ: at most this many calibration tokens

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ConfigError(f"method must be one of {', '.join(QUANT_METHODS)}, got {self.method!r}")
        if self.rule not in RULES:
            raise ConfigError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.calibration_tokens <= 0:
            raise ConfigError(f"--calibration-tokens must be > 0, got {self.calibration_tokens}")
        if not 0 < self.damp <= MAX_DAMP:
            raise ConfigError(f"--damp must be in (0, {MAX_DAMP:g}], got {self.damp}")
        if self.rotate is None:  # rotation helps GPTQ, hurts round to nearest (docs/benchmarks.md)
            self.rotate = self.method == "gptq"

    def record(self) -> dict:
        """The settings as the checkpoint's metadata stores them (to tell whether a cached one fits)."""
        return {**asdict(self), "calibration": str(self.calibration) if self.calibration else None}


@dataclass(frozen=True, slots=True)
class QuantizeResult:
    """What `quantize_to_checkpoint` wrote (or found in the cache, made with the same settings)."""

    path: Path
    linears: int  # how many linears are stored as MXFP4
    method: str  # how, in one word (quant.checkpoint.describe): "gptq-rot", "rtn-mse", ...
    seconds: float  # quantization time, saving excluded (of the run that made it, for a cached one)
    reused: bool = False  # the cache already held it
    calibration_tokens: int | None = None  # GPTQ: the tokens it calibrated on (the text's, up to the most asked)

    @classmethod
    def of(cls, path: Path, linears: int, meta: dict, reused: bool = False) -> QuantizeResult:
        """The result of a checkpoint whose metadata is `meta` (as written, or read back from the cache)."""
        tokens = meta.get("gptq", {}).get("calibration_tokens")
        return cls(path, linears, describe(meta), meta["seconds"], reused, tokens)


def cached_result(source: Path, settings: QuantizeSettings) -> QuantizeResult | None:
    """The toggle's cached checkpoint of `source`, if one was made with `settings`."""
    path = cache_dir(source)
    if not is_mxfp4_checkpoint(path):
        return None
    meta = read_metadata(path)
    if meta.get("settings") != settings.record():
        return None
    return QuantizeResult.of(path, len(meta["quantized"]), meta, reused=True)


def quantize_to_checkpoint(
    model: nn.Module,
    encode: Callable[[str], Sequence[int]],
    settings: QuantizeSettings,
    source: Path,
    source_name: str,
    tokenizer_dir: Path,
    out: Path | None = None,
    progress: Progress | None = None,
) -> QuantizeResult:
    """Quantize the linears of `model` (loaded from `source`) and write an MXFP4 checkpoint.

    encode: the model's tokenizer, for the GPTQ calibration text. out: the checkpoint directory; None means the
    cache that the live MXFP4 toggle reads for this source (quant.checkpoint.cache_dir), where a checkpoint made
    with the same settings is reused. A user's mistake (the source is MXFP4 already, a layer selection that
    matches nothing) is a ConfigError.
    """
    if is_mxfp4_checkpoint(source):
        raise ConfigError(f"{source} is already an MXFP4 checkpoint")
    if out is not None:
        out = Path(os.path.abspath(out))  # "a/b/.." is "a": the partial checkpoint goes beside that
        check_out_dir(out)
    if out is None and (cached := cached_result(source, settings)) is not None:
        return cached
    try:
        names = select_linears(model, settings.layers)
    except ValueError as exc:
        raise ConfigError(f"--layers: {exc}") from None
    started = time.perf_counter()
    meta = {
        "method": settings.method,
        "rule": settings.rule,
        "rotation": ROTATION if settings.rotate else None,
        "layers": settings.layers,
        "source": source_name,
        "source_path": str(source),
        "settings": settings.record(),
    }
    if settings.method == "rtn":
        packed = round_to_nearest(model, names, settings.rule, settings.rotate, progress)
    else:
        text = settings.calibration.read_text() if settings.calibration else calibration_text()
        sequences = calibration_sequences(encode(text), settings.calibration_tokens)
        gptq = GptqSettings(
            rule=settings.rule, damp=settings.damp, act_order=settings.act_order, rotate=settings.rotate
        )
        tokens = sum(len(s) for s in sequences)
        try:
            packed = calibrate(model, sequences, names, gptq, progress=progress)
        except torch.linalg.LinAlgError:  # H + damp x mean(diag H) not positive definite: too little of either
            raise ConfigError(
                f"GPTQ: a layer's Hessian is singular with --damp {settings.damp} on {tokens} calibration tokens: "
                f"raise --damp (default {DEFAULT_DAMP}) or give more --calibration text"
            ) from None
        meta["gptq"] = {"damp": settings.damp, "act_order": settings.act_order, "calibration_tokens": tokens}
        meta["calibration"] = str(settings.calibration or f"specchat/data/text/{CALIBRATION_TEXT}")
    meta["seconds"] = round(time.perf_counter() - started, 1)
    meta["created"] = datetime.now(UTC).isoformat(timespec="seconds")
    target = cache_dir(source) if out is None else out
    write_whole(target, model, packed, tokenizer_dir, meta)
    return QuantizeResult.of(target, len(packed), meta)


def check_out_dir(out: Path) -> None:
    """Refuse an --out the checkpoint cannot go to, or whose files it would replace: a file, a folder holding
    anything but an MXFP4 checkpoint's own files (the source model's folder among them), a place that cannot be
    made. An earlier checkpoint there is replaced whole."""
    if Path(os.path.abspath(out)) == Path.cwd():  # the checkpoint replaces its folder whole: not the one we are in
        raise ConfigError(f"--out {out}: the current folder; give a folder to make, such as {out / 'q'}")
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out}: not a folder")
        if out.is_dir() and any(out.iterdir()):
            others = sorted(p.name for p in out.iterdir() if p.name not in CHECKPOINT_FILES)
            if others or not is_mxfp4_checkpoint(out):
                what = f"holds {others[0]}" if others else "holds a model that is not an MXFP4 checkpoint"
                raise ConfigError(f"--out {out}: the folder {what}; give a new or empty folder")
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot read it ({exc.strerror or exc})") from None
    # (the checkpoint is written beside `out`, then renamed; checked before the minutes of GPTQ)
    check_writable_folder(out.parent, f"--out {out}")


def write_whole(target: Path, model: nn.Module, packed: Packed, tokenizer_dir: Path, meta: dict) -> None:
    """Write the checkpoint under a temporary name beside `target`, then put it in `target`'s place: a run cut
    short leaves `target` as it was (an earlier checkpoint, or nothing)."""
    write_folder_whole(target, lambda folder: save_mxfp4_checkpoint(folder, model, packed, tokenizer_dir, meta))
