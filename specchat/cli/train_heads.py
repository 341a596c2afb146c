"""`specchat train-heads`: self-distil draft heads for a model from the shipped prompt set."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import click

from specchat.cli.inputs import given_path
from specchat.cli.options import StderrProgress, engine_config, given_flags, model_options
from specchat.config import SEED_MAX
from specchat.errors import ConfigError
from specchat.writes import check_writable_folder

# Flags of one --arch only (their parameter names); given with the other, they are refused rather than ignored.
HEADS_ONLY = ("num_heads", "parallel", "labels", "batch_size")  # (--tap has its own message)
EAGLE_ONLY = ("batch_tokens", "ttt_steps")

PLAIN_PROGRESS_EVERY_S = 10.0  # without a terminal: one progress line this often


class LineProgress:
    """A progress bar on a terminal, a line every few seconds (and at each stage's end) otherwise."""

    def __init__(self) -> None:
        self.bar = StderrProgress() if sys.stderr.isatty() else None
        self.last = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar(what, done, total)
            return
        now = time.monotonic()
        if now - self.last >= PLAIN_PROGRESS_EVERY_S or done >= total:
            click.echo(f"{what}: {done}/{total}", err=True)
            self.last = now


def is_heads_file(path: Path) -> bool:
    """A draft heads file that train-heads wrote (its safetensors metadata says so)."""
    from safetensors import SafetensorError, safe_open

    from specchat.engine.drafters.heads import HEADS_FORMAT

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("format") == HEADS_FORMAT
    except (OSError, SafetensorError, ValueError):
        return False


def is_eagle_folder(path: Path) -> bool:
    """A folder holding an EAGLE-3 head's files and nothing else (config.json names its eagle_config)."""
    from specchat.engine.drafters.eagle import HEAD_FILES

    try:
        if not {p.name for p in path.iterdir()} <= set(HEAD_FILES):
            return False
        return "eagle_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def is_empty_folder(path: Path) -> bool:
    try:
        return not any(path.iterdir())
    except OSError:
        return False  # unreadable: not known to be empty


def check_places(out: Path, work: Path, arch: str) -> None:
    """--out and the work folder, before the model loads: a place the result cannot go to failed at the save,
    after all the training. What --out names is replaced by the result, so it must be an earlier result (or
    nothing): `--arch eagle --out MODEL_DIR` replaced the model's own config.json and model.safetensors."""
    out_at, work_at = Path(os.path.abspath(out)), Path(os.path.abspath(work))
    if work_at == out_at or out_at in work_at.parents:  # the result replaces --out whole, work files and all
        raise ConfigError(f"--work {work}: the same as or inside --out {out}, which the result replaces")
    if arch == "heads" and out.is_dir():
        raise ConfigError(f"--out {out}: a folder; draft heads are one file (give FILE.safetensors)")
    if arch == "heads" and out.exists() and not is_heads_file(out):
        raise ConfigError(
            f"--out {out}: a file that is not draft heads, which the heads would replace; give a new file"
        )
    if arch == "eagle" and out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file; an EAGLE-3 head is a folder")
    if arch == "eagle" and out.is_dir() and not is_eagle_folder(out) and not is_empty_folder(out):
        raise ConfigError(
            f"--out {out}: the folder holds files other than an EAGLE-3 head's, which the head would replace; "
            "give a new or empty folder"
        )
    for what, folder in (("--out", out.parent), ("the work folder (--work)", work)):
        check_writable_folder(folder, what)


@click.command("train-heads")
@model_options
@click.option(
    "--arch",
    type=click.Choice(["heads", "eagle"]),
    default="heads",
    show_default=True,
    help="heads: MLP draft heads (a .safetensors file); eagle: an EAGLE-3 head (a directory vLLM and SGLang load too)",
)
@click.option("--out", required=True, type=click.Path(), help="heads file (eagle: directory) to write")
@click.option("--work", type=click.Path(file_okay=False), help="answers, features, checkpoints (default OUT.work)")
@click.option("--heads", "num_heads", type=int, default=4, show_default=True, help="draft heads (most drafts a step)")
@click.option("--tap", type=int, default=None, help="target layer the heads read (default: the last)")
@click.option("--parallel", is_flag=True, help="Medusa-style independent heads instead of sequential ones")
@click.option(
    "--draft-vocab", type=int, default=None, help="tokens drafted from; 0 = all (default: 16384 heads, 8192 eagle)"
)
@click.option("--max-tokens", type=int, default=384, show_default=True, help="per generated answer")
@click.option("--samples", type=int, default=2, show_default=True, help="sampled answers per prompt besides greedy")
@click.option(
    "--synth-prompts",
    type=int,
    default=0,
    show_default=True,
    help="user prompts the model writes itself (Magpie), answered greedily beside the shipped ones",
)
@click.option(
    "--labels",
    type=click.Choice(["soft", "greedy", "text"]),
    default=None,
    help="heads: learn the target's whole distribution after each prefix (soft; the default with the last layer "
    "tapped), its greedy choice there (greedy; the default with another --tap), or the answers' own tokens (text)",
)
@click.option("--epochs", type=int, default=None, help="default: 4 (heads), 6 (eagle)")
@click.option("--batch-size", type=int, default=512, show_default=True, help="heads: positions per step")
@click.option("--batch-tokens", type=int, default=8192, show_default=True, help="eagle: padded tokens per step")
@click.option("--ttt-steps", type=int, default=5, show_default=True, help="eagle: chain depth trained")
@click.option("--lr", type=float, default=None, help="default: 2e-3 (heads), 1e-3 (eagle)")
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=0, show_default=True)
@click.option(
    "--max-prompts", type=click.IntRange(min=1), default=None, help="train on the first N prompts only [default: all]"
)
@click.option("--max-running", type=int, default=64, show_default=True, help="answers generated concurrently")
def train_heads(
    model,
    device,
    dtype,
    arch,
    out,
    work,
    num_heads,
    tap,
    parallel,
    draft_vocab,
    max_tokens,
    samples,
    synth_prompts,
    labels,
    epochs,
    batch_size,
    batch_tokens,
    ttt_steps,
    lr,
    seed,
    max_prompts,
    max_running,
    **model_extra,
) -> None:
    """Train draft heads for MODEL (default: smollm2-135m) on its own answers; resumes an interrupted run."""
    from specchat.engine.engine import Engine
    from specchat.engine.train_eagle import EagleTrainConfig, train_eagle
    from specchat.engine.train_heads import TrainConfig
    from specchat.engine.train_heads import train_heads as run_training

    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be > 0, got {max_tokens}")
    if epochs is not None and epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {epochs}")
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"--lr must be a finite number > 0, got {lr}")
    if tap is not None and arch == "eagle":
        raise click.UsageError("--tap is for --arch heads (an EAGLE-3 head reads three layers of its own choice)")
    other_arch = given_flags(click.get_current_context(), EAGLE_ONLY if arch == "heads" else HEADS_ONLY)
    if other_arch:  # refused, not ignored: `--arch eagle --heads 8` trained the eagle head it always trains
        other = "eagle" if arch == "heads" else "heads"
        raise click.UsageError(f"{', '.join(other_arch)}: for --arch {other}, not --arch {arch}")
    vocab = draft_vocab if draft_vocab is not None else (8192 if arch == "eagle" else 16384)
    data = {"draft_vocab": vocab, "max_tokens": max_tokens, "samples_per_prompt": samples, "seed": seed}
    data |= {"synth_prompts": synth_prompts, "max_prompts": max_prompts or 0}  # 0: every prompt of the train split
    if arch == "eagle":
        cfg = EagleTrainConfig(
            **data, ttt_steps=ttt_steps, epochs=epochs or 6, batch_tokens=batch_tokens, lr=lr or 1e-3
        )
    else:
        cfg = TrainConfig(
            **data,
            num_heads=num_heads,
            tap=tap,
            sequential=not parallel,
            labels=labels,
            epochs=epochs or 4,
            batch_size=batch_size,
            lr=lr or 2e-3,
        )
    out = given_path(out, "--out")
    work = given_path(work, "--work") if work is not None else Path(os.path.abspath(out) + ".work")
    check_places(out, work, arch)
    config = engine_config(model, device, dtype, max_running=max_running, **model_extra)  # model_extra: --weights
    engine = Engine.load(config, progress=StderrProgress())
    layers = engine.model.cfg.num_layers
    if tap is not None and not 0 <= tap < layers:  # before any answer is generated
        raise ConfigError(f"--tap must be a layer of this model, in [0, {layers - 1}], got {tap}")
    log = lambda line: click.echo(line, err=True)
    train = train_eagle if arch == "eagle" else run_training
    try:
        report = train(engine, cfg, out, LineProgress(), log, work)
    except OSError as exc:  # a work file that cannot be written (a full disk): one line, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        raise ConfigError(f"{where}{exc.strerror or exc}") from None
    except KeyboardInterrupt:  # Ctrl-C: what was done is kept, and the run said nothing of it
        click.echo(f"\nspecchat: interrupted; {out} not written. The same command resumes from {work}", err=True)
        raise click.exceptions.Exit(130) from None  # (told: not `report`'s plain line again)
    label = "step" if arch == "eagle" else "head"
    rows = zip(report["top1"], report["tokens_per_step"], report["run_tokens_per_step"], strict=True)
    for i, (acc, tps, run) in enumerate(rows):
        click.echo(
            f"{label} {i + 1}: top-1 {acc:.3f}   at k={i + 1}: chain estimate {tps:.2f}, "
            f"greedy run {run:.2f} tokens/step"
        )
    click.echo(f"wrote {out} ({report['eval_positions']} held-out positions scored)")


def register(group: click.Group) -> None:
    group.add_command(train_heads)
