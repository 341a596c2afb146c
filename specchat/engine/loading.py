"""Everything between a model name and a ready engine: device and dtype, weights, tokenizer, KV budget, runner.

`load_parts(config)` resolves the model (models.toml alias, HF directory or hub id, GGUF file), fetches it if
needed, loads the checkpoint onto the device, applies the weight format and sizes the KV pool from the memory
budget. Engine.load and the draft-model drafter both build from here.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specchat.config import EngineConfig
from specchat.engine import cpu_fusion
from specchat.engine.cpu_weights import (
    deferred_tensors,
    pack_blocks,
    release_unread_weights,
    set_activations,
)
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_transform import load_or_calibrate
from specchat.engine.loader import Progress, build_model, load_checkpoint, one_parse_per_file
from specchat.engine.model import Transformer
from specchat.engine.runner import ModelRunner
from specchat.engine.tokenizer import Tokenizer, load_tokenizer
from specchat.errors import ConfigError, ModelFormatError
from specchat.kernels import cpu_block, cpu_build, cpu_gemv, cpu_gemv_i8
from specchat.quant.checkpoint import checkpoint_metadata, take_packed
from specchat.quant.handler import WeightSwitch, weight_switch
from specchat.registry import (
    ModelSpec,
    damaged_download,
    derived_dir,
    fetch,
    is_download,
    resolve,
    tokenizer_dir,
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET = 1 << 30  # bytes; pages are allocated lazily by the OS, so unused capacity costs nothing
GPU_KV_FRACTION = 0.5  # of the memory free after loading the weights


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(name)


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU computes in bfloat16 natively (the avx512_bf16 or AMX-BF16 flags of /proc/cpuinfo); without
    them torch emulates bfloat16 arithmetic in float32 and gains nothing from the halved weights."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str | None, device: torch.device, cpu_blocks: bool = False) -> torch.dtype:
    """The model dtype: as asked; for `auto` (or None), bfloat16 on CUDA and on a CPU with native bfloat16,
    float32 on other CPUs and wherever `cpu_blocks` (a GGUF model the CPU's C kernels will read as Q4_1 / Q8_0
    blocks, whatever its quantized types: they compute in float32 and decode 5.6x faster than torch's bfloat16
    linears on an AMX CPU, docs/benchmarks.md)."""
    if name in (None, "auto"):
        native = device.type == "cuda" or (cpu_has_native_bf16() and not cpu_blocks)
        name = "bfloat16" if native else "float32"
    return TORCH_DTYPES[name]


def reads_cpu_blocks(spec: ModelSpec, cpu_kernels: bool) -> bool:
    """Whether the CPU's block kernels will read this model's GGUF blocks (see pack_cpu_weights)."""
    return cpu_kernels and spec.source in ("pypi", "gguf") and cpu_gemv.available()


def cpu_threads() -> int:
    """Torch (and CPU kernel) threads: the cores this process may run on, or as set when OMP_NUM_THREADS is. While
    the engine steps, its ThreadGovernor drops to one thread when other processes keep the cores busy (the 1-minute
    load average this read until 2026-12-05 lags by a minute either way: a test run just ended left it at 1 on an
    idle 2-core machine, and one thread decoded at 34-43 tok/s where two reach 64-67)."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ThreadGovernor:
    """The CPU threads while the engine runs: other processes busy on the cores make every OpenMP barrier (~250 a
    decode step) wait a time slice for a descheduled thread (2 cores, one other busy process: plain decoding 18-22
    tok/s on 2 threads against 34-41 on 1; two: 4-18 against 24-39; docs/benchmarks.md, thirty-fifth session).
    Over each WINDOW_S seconds of steps it compares the CPU time the process got with what its threads could use;
    below LOW of it (they wait descheduled) it drops to one thread, and after PROBE_S seconds of steps on one it
    tries the full count again for a window."""

    WINDOW_S = 0.5
    PROBE_S = 20.0
    LOW = 0.7

    @classmethod
    def for_device(cls, device: torch.device) -> ThreadGovernor | None:
        """One for an engine on the CPU with more than one thread of its own choosing (not OMP_NUM_THREADS')."""
        threads = torch.get_num_threads()
        if device.type != "cpu" or threads < 2 or "OMP_NUM_THREADS" in os.environ:
            return None
        return cls(threads)

    def __init__(self, threads: int, clock=time.perf_counter, cpu_time=time.process_time) -> None:
        self.full = threads
        self.clock, self.cpu_time = clock, cpu_time
        self.wall = self.cpu = 0.0  # this window's step time and the process's CPU time in it
        self.since_drop = 0.0  # seconds of steps run on one thread since it dropped (0 while on full)

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def step(self, run, *args):
        """run(*args) timed as a step; the thread count for the next steps chosen from the window it closes."""
        wall0, cpu0 = self.clock(), self.cpu_time()
        try:
            return run(*args)
        finally:
            self.wall += self.clock() - wall0
            self.cpu += self.cpu_time() - cpu0
            if self.wall >= self.WINDOW_S:
                self._choose()

    def _choose(self) -> None:
        threads, share = self.threads, self.cpu / (self.wall * self.threads)
        if threads == 1 and self.full > 1:
            self.since_drop += self.wall
            if self.since_drop >= self.PROBE_S:  # the other process may have ended
                torch.set_num_threads(self.full)
                self.since_drop = 0.0
        elif threads > 1 and share < self.LOW:
            torch.set_num_threads(1)
        self.wall = self.cpu = 0.0


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_FRACTION)
    return CPU_KV_BUDGET


def make_runner(model: Transformer, pool: KVPool, eager: bool) -> ModelRunner:
    """The step runner: on CUDA, unless `eager`, fused elementwise kernels and CUDA graphs for decode and
    verification steps (docs/gpu.md); the plain ModelRunner otherwise (and always on the CPU)."""
    if eager or pool.device.type != "cuda":
        return ModelRunner(model, pool)
    from specchat.engine.cuda_graph import CudaGraphRunner
    from specchat.engine.fusion import fuse

    fuse(model)
    return CudaGraphRunner(model, pool)


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, progress: Progress | None = None, blocks: bool = False
):
    """(model on the device, packed MXFP4 weights, checkpoint metadata and the converted weights file, if any: what
    the weight switch needs) of the fetched model at `path`. `blocks`: the CPU kernels will read its quantized
    linears as blocks (pack_cpu_weights), so a large GGUF's are not dequantized (loader.load_gguf's `defer`)."""
    cache = derived_dir(path) / "weights.safetensors" if path.is_file() else None
    defer = deferred_tensors if blocks else None
    model_cfg, state = load_checkpoint(path, progress=progress, cache=cache, defer=defer)
    packed, meta = take_packed(state), checkpoint_metadata(path)
    model = build_model(model_cfg, state, dtype, device, where=path)
    return model, packed, meta, cache


def check_vocabulary(tokenizer: Tokenizer, model: Transformer, path: Path) -> None:
    """A tokenizer whose vocabulary runs past the model's embedding rows (a tokenizer of another model, a vocab_size
    cut short) fails every prompt that meets such a token inside the step (an IndexError); said once, at load. Its
    added tokens are left out: transformers' GGUF converter adds <s>, </s> and <unk> where a vocabulary lacks
    them, which only a prompt that spells them out meets."""
    tokens = tokenizer.backend.get_vocab_size(with_added_tokens=False)
    if tokens > model.cfg.vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {tokens} tokens, the model's embedding only {model.cfg.vocab_size} rows "
            "(a tokenizer of another model?)"
        )


def pack_cpu_weights(
    model: Transformer, path: Path, converted: Path | None, cpu_act: str, progress: Progress | None = None
) -> None:
    """A CPU model, for the C kernels (not --eager): its linears that a GGUF file stores quantized read Q4_1 / Q8_0
    blocks (as stored, or converted: cpu_weights.AS_Q4_1), with the activation rows `cpu_act` picks, and the CPU
    kernels' modules swapped in (cpu_fusion.fuse; a bf16 model's linears: cpu_weights.Bf16Linear). At load, and
    again where a switch back from MXFP4 weights (Engine.set_weights) has put plain dense linears in their
    place."""
    if path.is_file():
        cache = converted.parent / "cpu_blocks.safetensors" if converted else None
        pack_blocks(model, path, cache=cache, progress=progress)
        unread = [name for name, p in model.named_parameters() if p.is_meta]
        if unread:  # (load_gguf deferred them for the blocks, which did not take them: a bug, said plainly)
            raise ModelFormatError(f"{path}: {unread[0]} was left for the CPU blocks, which did not read it")
    if cpu_act == "int8":
        use_cpu_activations(model, cpu_act, cpu_kernels=True)  # its ConfigError where no linear can
    use_cpu_rows(model, cpu_act)
    cpu_fusion.fuse(model)


def use_cpu_rows(model: Transformer, cpu_act: str) -> None:
    """The activation rows `cpu_act` picks for the linears the CPU kernels read (GGUF blocks, MXFP4 codes): int8 for
    int8, and for auto where cpu_gemv_i8 loads (the linears that can take them: the rest keep float rows); then what
    int8 rows never read is released (cpu_weights.release_unread_weights). At load, and after a switch of the
    weights (Engine.set_weights)."""
    if cpu_act == "int8" or (cpu_act == "auto" and cpu_gemv_i8.available()):
        set_activations(model, "int8")
    release_unread_weights(model)


def use_cpu_activations(model: Transformer, activations: str, cpu_kernels: bool) -> None:
    """--cpu-act int8: the GGUF-block and MXFP4 linears take int8 activation rows; a ConfigError where they cannot."""
    flag = f"--cpu-act {activations}"
    if not cpu_kernels:
        raise ConfigError(f"{flag} needs the CPU block kernels: a CPU device (--device cpu or auto without CUDA)")
    if not cpu_gemv_i8.available():
        raise ConfigError(f"{flag} needs a CPU with AVX512-VNNI or AVX2 and a C compiler; use --cpu-act fp32 here")
    if set_activations(model, activations) == 0:
        raise ConfigError(f"{flag} needs quantized GGUF weights read as blocks or MXFP4 weights (float32)")


@dataclass(slots=True)
class LoadedModel:
    """What an Engine is built from."""

    spec: ModelSpec
    model: Transformer
    tokenizer: Tokenizer
    pool: KVPool
    weights: WeightSwitch


KERNEL_STAGE = "building the CPU kernels for this machine (once)"


def start_cpu_kernels(progress: Progress | None) -> threading.Event | None:
    """Start compiling the CPU kernels on a thread of their own where `build_cpu_kernels` would build them, so that
    the compiler runs while the model downloads; the Event is set when it is done. None: nothing to build here."""
    if progress is None or not cpu_build.enabled() or cpu_block.built():
        return None  # (without a progress to hear it, the kernels build at their first use)
    done = threading.Event()

    def compile_them() -> None:
        try:
            cpu_block.available()  # (a failed build is the torch path, with a note: it raises nothing)
        finally:
            done.set()

    threading.Thread(target=compile_them, daemon=True).start()
    return done


def build_cpu_kernels(progress: Progress | None, beat_s: float = 1.0, started: threading.Event | None = None) -> None:
    """The CPU kernels compiled where they are not yet (once per machine, compiler and version: ~15-20 s on 2 cores),
    the wait shown as a stage of the load rather than as a silent first call: `progress` hears the stage every
    `beat_s` while the compiler runs (so a log, where stderr is not a terminal, gets its "still running" line).
    `started`: the build `start_cpu_kernels` began, waited for here."""
    done = started if started is not None else start_cpu_kernels(progress)
    if done is None or progress is None:
        return
    progress(KERNEL_STAGE, 0, 0)
    while not done.wait(beat_s):
        progress(KERNEL_STAGE, 0, 0)
    progress(KERNEL_STAGE, 1, 1)


def load_parts(config: EngineConfig, progress: Progress | None = None) -> LoadedModel:
    """Resolve, fetch (if needed) and load a model by alias or path, with its tokenizer and KV pool."""
    spec = resolve(config.model)
    device = pick_device(config.device)
    cpu_kernels = device.type == "cpu" and not config.eager  # the C kernels; --eager keeps plain torch
    # the kernels' first build runs while the model downloads (a model that cannot be fetched fails at once; the
    # build, on a daemon thread, goes on only while the process does)
    compiling = start_cpu_kernels(progress) if cpu_kernels else None
    path = fetch(spec, progress=progress)
    if compiling is not None:  # (None: nothing to build, or no progress to show it)
        build_cpu_kernels(progress, started=compiling)
    cpu_blocks = reads_cpu_blocks(spec, cpu_kernels)
    dtype = pick_dtype(config.dtype, device, cpu_blocks)
    blocks = cpu_blocks and dtype == torch.float32 and config.weights in ("auto", "bf16")  # (mxfp4 reads floats)
    with one_parse_per_file():  # (a first load reads a GGUF's tensors twice: float weights, then CPU blocks)
        try:
            model, packed, meta, converted = load_model(path, dtype, device, progress, blocks)
            tokenizer = load_tokenizer(spec, path)
        except ModelFormatError as exc:  # our own download, damaged: the error says how to fetch it again
            if is_download(spec, path):
                raise damaged_download(spec, exc) from None
            raise
        check_vocabulary(tokenizer, model, path)
        weights = weight_switch(
            model,
            packed,
            meta,
            path,
            config.weights,
            dense_file=converted,
            encode=tokenizer.encode,
            tokenizer_dir=tokenizer_dir(spec, path),
            progress=progress,
        )
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads())
        if cpu_kernels:
            pack_cpu_weights(model, path, converted, config.cpu_act, progress)
        elif config.cpu_act == "int8":  # --device auto that found CUDA: its one-line error
            use_cpu_activations(model, config.cpu_act, cpu_kernels)
    budget = config.kv_memory or default_kv_budget(device)
    c = model.cfg
    pool = KVPool.from_budget(
        budget,
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        config.page_size,
        dtype,
        device,
        config.kv_format,
        rotate=config.kv_rotation,
        key_transform=(
            (lambda: load_or_calibrate(model, tokenizer.encode, path, weights.current))
            if config.kv_key_transform
            else None
        ),
        cpu_kernels=cpu_kernels,
    )
    return LoadedModel(spec, model, tokenizer, pool, weights)
