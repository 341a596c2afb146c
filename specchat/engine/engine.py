"""Engine: the one way the CLI, the UI and agents talk to the model.

    engine = Engine.load(EngineConfig(model="smollm2-135m"))
    for event in engine.generate("Write a haiku", SamplingParams(max_tokens=64)):
        ...  # TextDelta, StepEvent, then one Finished

`submit` returns a RequestHandle whose `events()` yields that request's events. Without `start()` the
caller's thread drives the step loop while it waits for events; after `start()` a background thread does,
and callers only wait on their queues. Settings that change a running engine (k, drafter, ...) are queued
and applied between steps, so they take effect on the next step.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.adaptive import AdaptiveK
from specchat.engine.drafters import Drafter, make_drafter
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import PAGE_FORMATS, bytes_per_token
from specchat.engine.loader import Progress, build_model, load_checkpoint
from specchat.engine.model import Transformer
from specchat.engine.runner import ModelRunner
from specchat.engine.sampling import make_generator
from specchat.engine.scheduler import Scheduler
from specchat.engine.sequence import Event, Finished, Sequence
from specchat.engine.telemetry import EngineMetrics, Snapshot
from specchat.engine.tokenizer import StreamDecoder, Tokenizer, export_gguf_tokenizer
from specchat.errors import ConfigError, PromptError
from specchat.quant.checkpoint import checkpoint_metadata, take_packed
from specchat.quant.fp4_linear import Fp4Linear
from specchat.quant.handler import WEIGHT_FORMATS, WeightSwitch, weight_bytes, weight_switch
from specchat.registry import ModelSpec, derived_dir, fetch, resolve, tokenizer_dir

Prompt = str | list[dict] | list[int]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET = 1 << 30  # bytes; pages are allocated lazily by the OS, so unused capacity costs nothing
GPU_KV_FRACTION = 0.5  # of the memory free after loading the weights


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(name)


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_FRACTION)
    return CPU_KV_BUDGET


def make_runner(model: Transformer, pool: KVPool, eager: bool) -> ModelRunner:
    """The step runner: on CUDA, unless `eager`, fused elementwise kernels and CUDA graphs for decode and
    verification steps (docs/benchmarks.md); the plain ModelRunner otherwise (and always on the CPU)."""
    if eager or pool.device.type != "cuda":
        return ModelRunner(model, pool)
    from specchat.engine.cuda_graph import CudaGraphRunner
    from specchat.engine.fusion import fuse

    fuse(model)
    return CudaGraphRunner(model, pool)


class RequestHandle:
    """A submitted request: iterate its events, or cancel it."""

    def __init__(self, engine: Engine, request_id: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: queue.Queue[Event] = queue.Queue()
        self.finished: Finished | None = None

    def events(self) -> Iterator[Event]:
        while self.finished is None:
            if self.queue.empty() and not self.engine.running_in_background:
                self.engine.step()
                continue
            event = self.queue.get()
            if isinstance(event, Finished):
                self.finished = event
            yield event

    def result(self) -> Finished:
        """Wait for the end and return the Finished event."""
        for _ in self.events():
            pass
        return self.finished

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        pool: KVPool,
        config: EngineConfig,
        model_spec: ModelSpec | None = None,
        weights: WeightSwitch | None = None,
    ) -> None:
        self.model = model
        self.weights = weights or weight_switch(model, {}, None, None)
        self.tokenizer = tokenizer
        self.pool = pool
        self.config = config
        self.model_spec = model_spec
        self.device = pool.device
        self.runner = make_runner(model, pool, eager=config.eager)
        self.drafters: dict[str, Drafter] = {}
        self.scheduler = Scheduler(self.runner, self.drafter, config.max_running, config.max_batch_tokens)
        self.handles: dict[int, RequestHandle] = {}
        self.listeners: list[Callable[[list[Event]], None]] = []
        self.metrics = EngineMetrics()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False

    # --- construction ---------------------------------------------------------------------------------------
    @classmethod
    def load(cls, config: EngineConfig | None = None, progress: Progress | None = None) -> Engine:
        """Resolve, fetch (if needed) and load a model by alias or path."""
        config = config or EngineConfig()
        spec = resolve(config.model)
        path = fetch(spec, progress=progress)
        device = pick_device(config.device)
        dtype = DTYPES[config.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
        cache = derived_dir(path) / "weights.safetensors" if path.is_file() else None
        model_cfg, state = load_checkpoint(path, progress=progress, cache=cache)
        tokenizer = load_tokenizer(spec, path)
        packed, meta = take_packed(state), checkpoint_metadata(path)
        model = build_model(model_cfg, state, dtype, device)
        del state
        weights = weight_switch(model, packed, meta, path, config.weights)
        budget = config.kv_memory or default_kv_budget(device)
        c = model_cfg
        shape = (c.num_layers, c.num_kv_heads, c.head_dim, config.page_size)
        pool = KVPool.from_budget(budget, *shape, dtype, device, config.kv_format, rotate=config.kv_rotation)
        return cls(model, tokenizer, pool, config, spec, weights)

    def drafter(self, name: str) -> Drafter:
        if name not in self.drafters:
            self.drafters[name] = make_drafter(name, self)
        return self.drafters[name]

    # --- requests -------------------------------------------------------------------------------------------
    def encode_prompt(
        self, prompt: Prompt, system: str | None = None, raw: bool = False, tools: list | None = None
    ) -> list[int]:
        """A prompt (text, chat messages or token ids) -> token ids, validated against the context."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("empty prompt")
            if raw:
                ids = self.tokenizer.encode(prompt)
            else:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}
                ]
                ids = self.tokenizer.encode_chat(messages, tools=tools)
        elif prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.encode_chat(prompt, tools=tools)
        else:
            ids = list(prompt)
        if not ids:
            raise PromptError("empty prompt")
        limit = self.model.cfg.max_position
        if len(ids) >= limit:
            raise PromptError(f"prompt is {len(ids)} tokens; the model's context holds {limit}")
        return ids

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        spec: SpecParams | None = None,
        system: str | None = None,
        raw: bool = False,
        tools: list | None = None,
    ) -> RequestHandle:
        """Queue a request; errors in its parameters raise here and touch no other request."""
        sampling = sampling or SamplingParams()
        spec = spec or SpecParams(drafter="none")
        ids = self.encode_prompt(prompt, system=system, raw=raw, tools=tools)
        self.drafter(spec.drafter)  # unknown drafters fail now, in the caller
        seq = Sequence(
            seq_id=next(self._ids),
            prompt_ids=ids,
            sampling=sampling,
            spec=spec,
            detok=StreamDecoder(self.tokenizer, ids),
            eos_ids=self.tokenizer.stop_token_ids | set(self.model.cfg.eos_token_ids),
            max_position=self.model.cfg.max_position,
            generator=make_generator(sampling, self.device),
            k=spec.k if spec.k is not None else min(4, spec.k_max),
            adaptive=AdaptiveK(spec.k_max) if spec.k is None else None,
        )
        handle = RequestHandle(self, seq.seq_id)
        with self._lock:
            self.handles[seq.seq_id] = handle
            self.metrics.observe_submit(seq.seq_id)
            self.scheduler.add(seq)
        self._wake.set()
        return handle

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, **kwargs) -> Iterator[Event]:
        """Submit and iterate the request's events."""
        yield from self.submit(prompt, sampling, **kwargs).events()

    def cancel(self, request_id: int) -> None:
        self.apply(lambda: self.scheduler.cancel(request_id))

    def _running_seqs(self, request_id: int | None) -> list[Sequence]:
        seqs = [*self.scheduler.waiting, *self.scheduler.running]
        return seqs if request_id is None else [s for s in seqs if s.seq_id == request_id]

    def set_k(self, k: int | None, request_id: int | None = None) -> None:
        """Draft length for one request (or all live ones): an int, or None for adaptive; next step on."""

        def change() -> None:
            for seq in self._running_seqs(request_id):
                seq.spec = SpecParams(drafter=seq.spec.drafter, k=k, k_max=seq.spec.k_max)
                seq.adaptive = AdaptiveK(seq.spec.k_max) if k is None else None
                seq.k = k if k is not None else seq.adaptive.best_k()

        self.apply(change)

    def set_drafter(self, name: str, request_id: int | None = None) -> None:
        """Switch the drafter of one request (or all live ones) from the next step on."""
        self.drafter(name)  # unknown names fail here, in the caller

        def change() -> None:
            for seq in self._running_seqs(request_id):
                self.drafter(seq.spec.drafter).release(seq)
                seq.spec = SpecParams(drafter=name, k=seq.spec.k, k_max=seq.spec.k_max)

        self.apply(change)

    def set_kv(self, fmt: str) -> None:
        """Switch the KV page format (bf16 | fp16 | fp32 | mxfp4 | k8v4), converting live conversations in place.

        Runs between steps, like `apply`, but in the caller, so that a switch the memory budget cannot hold
        (live requests need more pages than the new format fits) raises KVCacheFullError here and changes nothing.
        """
        if fmt not in PAGE_FORMATS:
            raise ConfigError(f"kv format must be one of {', '.join(PAGE_FORMATS)}, got {fmt!r}")
        with self._lock:
            self._drain_commands()
            self.pool.convert(fmt)

    def set_weights(self, fmt: str) -> Future:
        """Switch the linear weights between "bf16" (unquantized, the model dtype) and "mxfp4" between steps.

        Running requests continue: their KV cache is kept, only the next steps use the new weights; cached
        prefixes of finished requests are dropped. What the switch back needs is kept
        (quant.handler.WeightSwitch): memory() reports it as weights_restore_bytes.
        """
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")

        def change() -> None:
            self.weights.set(fmt)
            self.pool.clear_prefix_cache()  # cached prefixes hold keys/values computed with the other weights

        return self.apply(change)

    def apply(self, command: Callable[[], None]) -> Future:
        """Run a change to engine state between steps (on the engine's thread).

        Returns a Future that completes when the change has run (and holds its error, if it failed); without
        a background thread the change runs now and its error is raised here.
        """
        done: Future = Future()
        self._commands.put((command, done))
        self._wake.set()
        if not self.running_in_background:
            with self._lock:
                self._drain_commands()
            done.result()
        return done

    def _drain_commands(self) -> None:
        while True:
            try:
                command, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception as exc:  # delivered to whoever waits on the Future
                done.set_exception(exc)
            else:
                done.set_result(None)

    # --- the step loop ----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Run one scheduler step and deliver its events."""
        with self._lock:
            self._drain_commands()
            events = self.scheduler.step()
            self.metrics.observe_events(events)
            for event in events:
                handle = self.handles.get(event.request_id)
                if handle is not None:
                    handle.queue.put(event)
                    if isinstance(event, Finished):
                        del self.handles[event.request_id]
        if events:
            for listener in self.listeners:
                listener(events)
        return events

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Run the step loop in a background thread from now on."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="specchat-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.scheduler.has_work() and self._commands.empty():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self.step()

    def close(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            self._thread = None

    # --- accounting -------------------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Start the engine-wide aggregates afresh (benchmarks measure one phase at a time)."""
        with self._lock:
            self.metrics = EngineMetrics()

    def snapshot(self) -> Snapshot:
        """Aggregate speculation, throughput, latency, queue depth and memory, now."""
        with self._lock:
            p50, p99 = self.metrics.latency_percentiles()
            return Snapshot(
                spec=copy.deepcopy(self.metrics.spec),
                tok_per_s=self.metrics.tok_per_s(),
                latency_p50_ms=p50,
                latency_p99_ms=p99,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                tokens_total=self.metrics.tokens_total,
                finished_total=self.metrics.finished_total,
                memory=self.memory(),
            )

    def memory(self) -> dict:
        """Bytes of weights and KV cache, and what they would be in bf16."""
        linear, linear_bf16 = 0, 0
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                linear += module.weight.numel() * module.weight.element_size()
                linear_bf16 += module.weight.numel() * 2
            elif isinstance(module, Fp4Linear):  # packed codes + scales are its only copy of the weight
                linear += module.nbytes
                linear_bf16 += module.in_features * module.out_features * 2
        return {
            "weights_bytes": weight_bytes(self.model),
            "linear_weight_bytes": linear,
            "linear_weight_bytes_bf16": linear_bf16,
            "weights_format": self.weights.current,  # "bf16" = unquantized, in the model dtype
            "weights_method": self.weights.method,  # how the MXFP4 weights were made: gptq (cached), rtn-mse, ...
            "weights_restore_bytes": self.weights.stash_bytes,  # host memory kept to switch back exactly
            **self.kv_memory(),
        }

    def kv_memory(self) -> dict:
        """KV cache accounting: format, bytes per token, used / cached / capacity, max context and sessions."""
        pool, c = self.pool, self.model.cfg
        max_context = min(c.max_position, pool.capacity_tokens)
        return {
            "kv_format": pool.store.name,
            "kv_bytes_per_token": pool.bytes_per_token,
            "kv_bytes_per_token_bf16": bytes_per_token("bf16", c.num_layers, c.num_kv_heads, c.head_dim),
            "kv_capacity_tokens": pool.capacity_tokens,
            "kv_capacity_bytes": pool.capacity_tokens * pool.bytes_per_token,
            "kv_used_tokens": pool.used_pages * pool.page_size,
            "kv_used_bytes": pool.used_pages * pool.page_size * pool.bytes_per_token,
            "kv_cached_tokens": pool.cached_pages * pool.page_size,  # evictable prefix cache, counted as free
            "kv_prefix_hit_tokens": pool.prefix_hit_tokens,
            "max_context": max_context,
            "max_sessions": pool.num_pages // pool.pages_for(max_context),  # concurrent, each at max_context
        }


def load_tokenizer(spec: ModelSpec, model_path: Path) -> Tokenizer:
    """The tokenizer of an HF directory, or the one converted (once, then cached) from a GGUF file."""
    folder = tokenizer_dir(spec, model_path)
    if model_path.is_file() and not (folder / "tokenizer.json").is_file():
        export_gguf_tokenizer(model_path, folder)
    return Tokenizer.from_dir(folder)
