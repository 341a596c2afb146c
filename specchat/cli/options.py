"""Options shared by several commands, and turning them into validated config objects."""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import click
from click.core import ParameterSource

from specchat.config import (
    CPU_ACTIVATIONS,
    DEVICES,
    DRAFTER_ARGS,
    DRAFTER_SYNTAX,
    DTYPE_CHOICES,
    KV_CHOICES,
    WEIGHT_CHOICES,
    EngineConfig,
    SamplingParams,
    SpecParams,
    check_drafter_name,
)
from specchat.errors import ConfigError, ModelNotFoundError, path_problem
from specchat.registry import default_model

cpu_act_option = click.option(
    "--cpu-act",
    type=click.Choice(CPU_ACTIVATIONS),
    default="auto",
    show_default=True,
    help="CPU, quantized GGUF weights: activation rows of the block kernels; int8 = per block of 32, AVX512-VNNI "
    "or AVX2 (auto: int8 where the CPU has it, fp32 elsewhere and with --eager)",
)

DTYPE_HELP = (
    "default auto: bfloat16 on CUDA and on CPUs with native bf16 (avx512_bf16/AMX), else float32; float32 for a GGUF"
    " model on the CPU (its C block kernels compute in float32)"
)


def given_flags(ctx: click.Context, names: Sequence[str]) -> list[str]:
    """The flags among parameters `names` that the command line (or the environment) set."""
    given = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    params = {p.name: p for p in ctx.command.params}
    return [params[name].opts[0] for name in names if ctx.get_parameter_source(name) in given]


def check_model_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The MODEL argument: left out means the default model, but an empty name is a mistake (a shell variable
    that was not set, say), not a request for the default."""
    if value is not None and not value.strip():
        raise ConfigError("the model name is empty: leave it out for the default model, or see `specchat models`")
    return value


model_argument = click.argument("model", required=False, callback=check_model_name)


def model_options(func):
    """MODEL argument + device / dtype / weights."""

    @model_argument
    @click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
    @click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        default=None,
        help=DTYPE_HELP,
    )
    @click.option(
        "--weights",
        type=click.Choice(WEIGHT_CHOICES),
        default="auto",
        show_default=True,
        help="linear weights: bf16 = unquantized (model dtype), mxfp4, auto = as the checkpoint stores them",
    )
    @click.option(
        "--kv",
        "kv_format",
        type=click.Choice(KV_CHOICES),
        default="auto",
        show_default=True,
        help="KV cache pages: auto = model dtype (fp16 for a float32 model on the CPU kernels), mxfp4 (-73% vs bf16), "
        "k8v4 = fp8 keys + mxfp4 values (-61%)",
    )
    @click.option(
        "--kv-memory", default=None, help="KV cache size, e.g. 512M or 8G (default: 1G on CPU, half the free GPU)"
    )
    @click.option(
        "--eager", is_flag=True, help="plain PyTorch modules: no fused kernels, CUDA graphs or CPU block kernels"
    )
    @cpu_act_option
    @functools.wraps(func)
    def wrapper(*args, kv_format, kv_memory, eager, cpu_act, **kwargs):
        kv_bytes = parse_bytes(kv_memory)
        if kv_bytes is not None:
            check_memory_ask(kv_bytes, kwargs["device"], f"--kv-memory {kv_memory}")
        # Kept on the click context for `engine_config`, so commands need not thread them through.
        click.get_current_context().meta[ENGINE_SETTINGS] = {
            "kv_format": kv_format,
            "kv_memory": kv_bytes,
            "eager": eager,
            "cpu_act": cpu_act,
        }
        return func(*args, **kwargs)

    return wrapper


ENGINE_SETTINGS = "specchat.engine"  # click context meta key of the KV, --eager and --cpu-act options
TP_SETTING = "specchat.tp"  # click context meta key of --tp


def tp_option(func):
    """--tp N: the model split over N GPUs (N processes on the CPU), rank 0 being this process (docs/gpu.md)."""

    @click.option(
        "--tp",
        type=int,
        default=1,
        show_default=True,
        help="tensor parallel: split the model over N GPUs (N processes with --device cpu)",
    )
    @functools.wraps(func)
    def wrapper(*args, tp, **kwargs):
        click.get_current_context().meta[TP_SETTING] = tp  # read by `engine_config`
        return func(*args, **kwargs)

    return wrapper


BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str | None) -> int | None:
    """'512M', '8G', '1.5G', '1000000' -> bytes (binary units; a trailing B or iB is allowed), at least one."""
    if text is None:
        return None
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in BYTE_UNITS else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number * BYTE_UNITS[unit] >= 1):
        raise ConfigError(f"--kv-memory must be a size of at least 1 byte like 512M or 8G, got {text!r}")
    return int(number * BYTE_UNITS[unit])


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def available_memory(device) -> int | None:
    """Bytes a new allocation can get: free memory of a CUDA device; on the CPU, MemAvailable within the cgroup's
    limit (Linux), else the physical memory; None where neither can be read (Windows has no sysconf)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = next(
            int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")
        )
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, StopIteration, ValueError):
        pass  # not Linux, or no cgroup v2 limit: what we have is the best estimate
    return available


def check_memory_ask(nbytes: int, device_name: str, what: str) -> None:
    """ConfigError if `nbytes` is more than the device (resolved from --device) has free."""
    from specchat.engine.loading import pick_device

    device = pick_device(device_name)
    free = available_memory(device)
    if free is not None and nbytes > free:  # (unknown: the allocation itself says so if it fails)
        where = "the GPU" if device.type == "cuda" else "this machine"
        raise ConfigError(f"{what} needs {gib(nbytes)} but {where} has {gib(free)} free")


def sampling_options(func):
    @click.option("--max-tokens", type=int, default=256, show_default=True)
    @click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
    @click.option("--top-p", type=float, default=1.0, show_default=True)
    @click.option("--top-k", type=int, default=0, show_default=True, help="0 = off")
    @click.option("--seed", type=int, default=None)
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


def spec_options(func=None, *, default_k: str = "auto"):
    """--drafter and --k, adaptive by default: one conversation on the CPU with the default drafter ran 1.36x plain
    decoding over the eval prompts against 1.32x at k = 4, and 1.00x against 0.90x on chat, where the drafts miss
    (docs/benchmarks.md, "Thirteenth session"); with many requests per step the draft gate turns drafting off at
    the batch sizes it does not pay at."""

    def decorate(func):
        @click.option(
            "--drafter",
            default="default",
            show_default=True,
            help=f"{DRAFTER_SYNTAX}; default: the model's models.toml drafter",
        )
        @click.option("--k", "k", default=default_k, show_default=True, help="draft tokens per step, or 'auto'")
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)

        return wrapper

    return decorate(func) if func is not None else decorate


def engine_config(model: str | None, device: str, dtype: str | None, **extra) -> EngineConfig:
    ctx = click.get_current_context(silent=True)
    settings = ctx.meta.get(ENGINE_SETTINGS, {}) if ctx is not None else {}
    if ctx is not None and TP_SETTING in ctx.meta:
        settings = {**settings, "tp": ctx.meta[TP_SETTING]}
    return EngineConfig(model=model or default_model(), device=device, dtype=dtype, **{**settings, **extra})


# The SamplingParams / SpecParams fields the sampling and speculation flags set, each as `--field-name`.
FLAG_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "drafter", "k")


def flag_error(error: ConfigError) -> ConfigError:
    """A SamplingParams / SpecParams error named by the flag that gave the value (`--k must be in [0, 8] or 'auto',
    got 20`): the config classes name the bare field, which the API, agent scripts and config.toml spell their
    own way. Read from `error.field`, never from the message's text."""
    return error.named(f"--{error.field.replace('_', '-')}") if error.field in FLAG_FIELDS else error


def sampling_params(stop: Sequence[str] = (), **fields: float | int | bool | None) -> SamplingParams:
    """The sampling flags' values as SamplingParams, by its field names (those a command has no flag for left at
    their defaults); a bad value is a ConfigError naming its flag."""
    try:
        return SamplingParams(stop=list(stop), **fields)
    except ConfigError as error:
        raise flag_error(error) from None


def check_drafter_arg(drafter: str, setting: str | None = None) -> None:
    """A drafter name, and the file, directory or model a `kind:ARG` drafter names exists (checked before the
    target loads). The error names `setting` where a file gave the value (config.toml's `drafter`), else the flag:
    `--drafter: unknown drafter ...`, `--drafter VALUE: why`."""
    try:
        kind, _, arg = check_drafter_name(drafter).partition(":")
    except ConfigError as error:
        raise (error.named(setting) if setting else flag_error(error)) from None
    if not arg:
        return
    where = setting or f"--drafter {drafter}"
    if DRAFTER_ARGS[kind] in ("FILE", "DIR"):
        why = path_problem(Path(arg).expanduser(), arg, directory=DRAFTER_ARGS[kind] == "DIR")
        if why is not None:
            raise ConfigError(f"{where}: {why}")
    if DRAFTER_ARGS[kind] == "NAME":
        from specchat.registry import resolve

        try:
            resolve(arg)
        except ModelNotFoundError as exc:
            raise ModelNotFoundError(f"{where}: {exc}") from None


def k_flag(k: str) -> int | None:
    """--k's value: draft tokens per step, None for 'auto'."""
    if k == "auto":
        return None
    try:
        return int(k)
    except ValueError:
        raise ConfigError(f"--k must be an integer or 'auto', got {k!r}") from None


def spec_params(drafter: str, k: str) -> SpecParams:
    """--drafter and --k as SpecParams; a k out of range is a ConfigError naming --k."""
    check_drafter_arg(drafter)  # a typo or a missing file fails before the model loads
    try:
        return SpecParams(drafter=drafter, k=k_flag(k))
    except ConfigError as error:
        raise flag_error(error) from None


class StderrProgress:
    """A one-line progress display on stderr for fetching and loading. Where stderr is not a terminal (a log, a
    pipe) a stage still running after LOG_AFTER_S gets a plain line, then one every LOG_EVERY_S: a first switch to
    MXFP4 (GPTQ) runs for minutes on a CPU, and without them a job's log said nothing at all."""

    LOG_AFTER_S, LOG_EVERY_S = 5.0, 60.0

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self.last = ""
        self.stage, self.stage_start, self.logged = "", 0.0, None

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            self._log(what, done, total)
            return
        if total:
            width = 30
            filled = int(width * done / total)
            line = f"{what} [{'#' * filled}{'.' * (width - filled)}] {100 * done // total:3d}%"
        else:
            line = f"{what} ..."
        if line != self.last:
            click.echo(f"\r\033[K{line}", err=True, nl=False)
            self.last = line
        if total and done >= total:
            click.echo("\r\033[K", err=True, nl=False)

    def _log(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if what != self.stage:
            self.stage, self.stage_start, self.logged = what, now, None
            return
        wait = self.LOG_AFTER_S if self.logged is None else self.LOG_EVERY_S
        if (total and done >= total) or now - (self.logged or self.stage_start) < wait:
            return
        elapsed = now - self.stage_start
        line = f"{what}: {100 * done // total}% after {elapsed:.0f} s" if total else f"{what}: {elapsed:.0f} s"
        if total and done:
            minutes = round(elapsed * (total - done) / done / 60)
            line += f", about {minutes} min left" if minutes else ", under a minute left"
        click.echo(line, err=True)
        self.logged = now
