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

import contextlib
import functools
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace

from specchat.config import K_MAX_LIMIT, KV_FORMATS, WEIGHT_FORMATS, EngineConfig, SamplingParams, SpecParams
from specchat.engine import cpu_fusion
from specchat.engine.adaptive import AdaptiveK
from specchat.engine.api import Prompt, default_drafter_name
from specchat.engine.drafters import Drafter, DrafterCache, make_drafter
from specchat.engine.drafters.base import NoDrafter
from specchat.engine.fusion import FusedTransformer, fuse_linears
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import auto_format
from specchat.engine.loader import Progress
from specchat.engine.loading import ThreadGovernor, load_parts, make_runner, pack_cpu_weights, use_cpu_rows
from specchat.engine.model import Transformer
from specchat.engine.prompt_bound import TokenBound
from specchat.engine.sampling import make_generator
from specchat.engine.scheduler import Scheduler
from specchat.engine.sequence import LOOP_FAILED, STEP_FAILED, Event, Finished, Sequence
from specchat.engine.spec_step import SpecStep
from specchat.engine.telemetry import EngineMetrics, Snapshot
from specchat.engine.tokenizer import Tokenizer
from specchat.errors import ConfigError, ContextLengthError, PromptError
from specchat.kernels import cpu_build
from specchat.quant.handler import WeightSwitch, weight_switch
from specchat.quant.modules import model_dtype
from specchat.registry import ModelSpec, cache_dir

log = logging.getLogger(__name__)

# Engine.load's CUDA warm-up captures verification widths up to k = 4 (what --k auto's gate tries first, and the
# widest a drafter of the default model needs before adaptive K raises it); wider ones capture at first use
WARM_UP_K = 4
# On the CPU a step that decodes requests feeds at most this many tokens of a prompt beside them
CPU_CHUNK_BESIDE_DECODING = 256  # (a 3,356-token prompt beside a stream: its longest gap 2.6 s -> 0.58 s)
# How a request live when the engine's step loop was closed (Engine.close) ends: Finished.error
ENGINE_CLOSED = "the engine was closed while the request ran"


class RequestHandle:
    """A submitted request: iterate its events, or cancel it.

    Its events reach it through its own queue, unless it was submitted with `listen_only=True`: then they
    reach only the engine's listeners (the TUI reads every request's events there, one batch per step).
    """

    def __init__(self, engine: Engine, request_id: int, listen_only: bool = False) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: queue.SimpleQueue[Event] | None = None if listen_only else queue.SimpleQueue()
        self.finished: Finished | None = None

    def events(self) -> Iterator[Event]:
        if self.queue is None:
            raise RuntimeError("this request was submitted with listen_only=True: its events go to the listeners")
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
    """The model, its KV pool, drafters and scheduler, and the step loop that drives them (see the module doc)."""

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
        self.drafters = DrafterCache(self._build_drafter)
        chunk = CPU_CHUNK_BESIDE_DECODING if self.device.type == "cpu" else None
        self.scheduler = Scheduler(
            pool, self.drafters, config.max_running, config.max_batch_tokens, self.runner.pads_widths, chunk
        )
        self.spec_step = SpecStep(self.runner, self.drafters)
        self.governor = ThreadGovernor.for_device(self.device)  # fewer CPU threads while other processes crowd them
        self.handles: dict[int, RequestHandle] = {}
        self.listeners: list[Callable[[list[Event]], None]] = []
        self.metrics = EngineMetrics()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False

    @classmethod
    def load(cls, config: EngineConfig | None = None, progress: Progress | None = None) -> Engine:
        """Resolve, fetch (if needed) and load a model by alias or path (engine.loading)."""
        config = config or EngineConfig()
        if config.tp > 1:  # the model split over config.tp ranks, this process being rank 0
            from specchat.engine.tp.launch import TPEngine

            return TPEngine.load_tp(config, progress)
        # Triton's compiled kernels under $SPECCHAT_HOME (unless the user chose a place): the next start reuses them
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
        parts = load_parts(config, progress)
        engine = cls(parts.model, parts.tokenizer, parts.pool, config, parts.spec, parts.weights)
        if config.warm_up:
            # widths up to WARM_UP_K; wider steps (a cap of 8 that timed faster, K raised live) capture their
            # graph at first use, ~65 ms. With the model's default
            # drafter on this device (what a chat drafts with unless told otherwise): its tapped step graphs and
            # drafting graphs too, so that a chat's first answer captures none (another drafter's, at first use)
            default = engine._drafter_name("default")
            engine.warm_up(progress, max_k=WARM_UP_K, drafters=[] if default == "none" else [default])
        engine.release_caller_threads()  # the loading thread may be a pool's (Textual's workers) and live on
        return engine

    def release_caller_threads(self) -> None:
        """On the CPU, end the calling thread's OpenMP workers: a thread other than the one that steps, done with
        its kernel work (loading, a weights or KV switch), must not keep them (`cpu_build.release_openmp_threads`
        says why). The next parallel region of this thread, if any, starts a pool again. That work also freed
        large buffers (a first load's dequantized weights, a switch's old modules): their pages go back."""
        if self.device.type == "cpu":
            cpu_build.release_openmp_threads()
            cpu_build.release_free_memory()

    @contextlib.contextmanager
    def _callers_kernel_work(self) -> Iterator[None]:
        """Kernel work a caller runs on its own thread (a switch, a drafter's build): while the engine's own thread
        steps, the caller's OpenMP workers end after it."""
        try:
            yield
        finally:
            if self.running_in_background and threading.current_thread() is not self._thread:
                self.release_caller_threads()

    def warm_up(
        self,
        progress: Progress | None = None,
        sessions: int = 1,
        drafters: Iterable[str] = (),
        max_k: int | None = None,
    ) -> None:
        """On CUDA, before the first request: one short prompt through prefill and plain decode (the kernels
        compile, into a Triton cache under $SPECCHAT_HOME that the next start reuses), then the graphs of every
        verification width up to max_k + 1 (default k_max + 1) for each batch bucket up to `sessions` (Engine.load:
        1, a chat; serve and bench ask for more), with the hidden-state taps of each of `drafters` too, and the
        drafters' own graphs (Drafter.warm_up). Leaves no cached prefix and fresh metrics. Nothing to do on the CPU
        or with --eager."""
        capture = getattr(self.runner, "warm_up", None)
        if capture is None:
            return
        if progress is not None:
            progress("warming up the GPU", 0, 1)
        prompt = self.tokenizer.encode("Warm-up: the quick brown fox jumps over the lazy dog.")
        self.submit(prompt, SamplingParams(max_tokens=4, temperature=0.0), SpecParams(drafter="none", k=0)).result()
        drafters = list(drafters)
        taps = [(), *(self.drafter(name).taps for name in drafters)]
        max_k = SpecParams().k_max if max_k is None else max_k
        capture(range(1, max_k + 2), sessions, taps, progress)
        for name in drafters:
            self.drafter(name).warm_up(sessions)
        self.spec_step.warm_up(sessions, drafters, max_k)
        with self._lock:
            self.pool.clear_prefix_cache()
        self.reset_metrics()

    @property
    def max_position(self) -> int:
        """Tokens the model's context holds (prompt + completion)."""
        return self.model.cfg.max_position

    def _drafter_name(self, name: str) -> str:
        """The name a request's drafter goes by: `default` as the drafter it stands for on this engine, so that
        both names share one drafter and the graphs warm-up captured for it."""
        return default_drafter_name(self) if name == "default" else name

    def drafter(self, name: str) -> Drafter:
        """The drafter called `name` (built on first use; an unknown name raises ConfigError)."""
        return self.drafters.get(name)

    def _build_drafter(self, name: str) -> Drafter:
        """DrafterCache's builder: a drafter's first use, often on a caller's thread (a request or a switch naming
        it)."""
        with self._callers_kernel_work():
            return make_drafter(name, self)

    # --- requests -------------------------------------------------------------------------------------------
    def encode_prompt(
        self, prompt: Prompt, system: str | None = None, raw: bool = False, tools: list | None = None
    ) -> list[int]:
        """A prompt (text, chat messages or token ids) -> token ids, validated against the context. A text too long
        to fit is refused before it is encoded: encoding megabytes takes seconds and holds the GIL (every stream and
        the server's /health stall meanwhile)."""
        limit, vocab = self.model.cfg.max_position, self.model.cfg.vocab_size
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            text, add_special_tokens = self._prompt_text(prompt, system, raw, tools)
            # (a token covers a character or more: a text shorter than the context cannot reach it)
            bound = self.token_bound if len(text) >= limit else None
            if bound is not None and (at_least := bound.reaches(text, limit)) is not None:
                raise ContextLengthError(_past_context(f"at least {at_least}", limit))
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            if ids and (past := max(ids)) >= vocab:  # (a token the tokenizer adds that the weights have no row for)
                piece = self.tokenizer.decode([past], skip_special_tokens=False)
                raise PromptError(
                    f"the prompt encodes to token {past} ({piece!r}), past the model's vocabulary of {vocab}: its "
                    f"tokenizer holds tokens its weights have no row for"
                )
        else:
            ids = list(prompt)
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:  # inside the step it would fail every request of the batch
                raise PromptError(f"token id {bad!r} is not in the model's vocabulary (0 .. {vocab - 1})")
        if not ids:
            raise PromptError("empty prompt")
        if len(ids) >= limit:
            raise ContextLengthError(_past_context(str(len(ids)), limit))
        return ids

    @functools.cached_property
    def token_bound(self) -> TokenBound | None:
        """The fewest tokens a text can encode to (None: prompts are encoded whole before they are measured); read
        from the vocabulary (~28 ms) at the first text as long as the context, not at every start."""
        return TokenBound.of(self.tokenizer.backend)

    def _prompt_text(
        self, prompt: str | list[dict], system: str | None, raw: bool, tools: list | None
    ) -> tuple[str, bool]:
        """The text a prompt of text or chat messages encodes from, and whether the tokenizer adds its special tokens
        (not to a rendered chat template, which holds the BOS token where the model wants one)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("empty prompt")
            if raw:
                return prompt, True
            prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tokenizer.render_chat(prompt, tools=tools), False

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        spec: SpecParams | None = None,
        system: str | None = None,
        raw: bool = False,
        tools: list | None = None,
        listen_only: bool = False,
    ) -> RequestHandle:
        """Queue a request; errors in its parameters raise here and touch no other request.

        `listen_only`: deliver its events only to the listeners, not to the handle (see RequestHandle).
        """
        sampling = sampling or SamplingParams()
        spec = spec or SpecParams(drafter="none")
        for value, kind in ((sampling, SamplingParams), (spec, SpecParams)):
            if not isinstance(value, kind):
                raise ConfigError(f"expected a {kind.__name__}, got {type(value).__name__} {value!r}")
        if not isinstance(prompt, (str, list, tuple)):
            raise PromptError(f"a prompt is text, chat messages or token ids, not {type(prompt).__name__}")
        spec = replace(spec, drafter=self._drafter_name(spec.drafter))
        ids = self.encode_prompt(prompt, system=system, raw=raw, tools=tools)
        drafter = self.drafter(spec.drafter)  # unknown drafters fail now, in the caller
        seq = Sequence(
            seq_id=next(self._ids),
            prompt_ids=ids,
            sampling=sampling,
            spec=spec,
            detok=self.tokenizer.stream(ids),
            eos_ids=self.tokenizer.stop_token_ids | set(self.model.cfg.eos_token_ids),
            max_position=self.model.cfg.max_position,
            generator=make_generator(sampling, self.device),
            k=_start_k(spec.k, spec.k_max, drafter, sampling),
            adaptive=_controller(spec.k_max, drafter, sampling) if spec.k is None else None,
        )
        handle = RequestHandle(self, seq.seq_id, listen_only)
        with self._lock:
            if not listen_only:
                self.handles[seq.seq_id] = handle
            self.metrics.observe_submit(seq.seq_id)
            self.scheduler.add(seq)
        self._wake.set()
        return handle

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, **kwargs) -> Iterator[Event]:
        """Submit and iterate the request's events. A caller that stops reading them (a break, close(), an exception
        in its loop) cancels the request, so its KV pages come back; a handle's events() may be read in pieces."""
        handle = self.submit(prompt, sampling, **kwargs)
        try:
            yield from handle.events()
        finally:
            if handle.finished is None:
                handle.cancel()

    def cancel(self, request_id: int) -> None:
        self.apply(lambda: self.scheduler.cancel(request_id))

    def end_all(self, error: str) -> Future:
        """End every live request between two steps with `error`, keeping what each wrote (a stopping server's
        answers in flight: server/stopping.py)."""
        return self.apply(lambda: self._deliver(self.scheduler.fail_all(error)))

    def _running_seqs(self, request_id: int | None) -> list[Sequence]:
        seqs = self.scheduler.live()
        return seqs if request_id is None else [s for s in seqs if s.seq_id == request_id]

    def set_k(self, k: int | None, request_id: int | None = None) -> None:
        """Draft length for one request (or all live ones): an int, or None for adaptive; next step on. The bound is
        each request's own k_max: every live request takes k up to its own; one named request refuses a k past it."""
        # the range check, here in the caller (also when the change runs later on the engine's thread): against the
        # named request's k_max, or the largest any request may have (the default k_max refused 12 under k_max 16)
        with self._lock:  # (after the step running now)
            named = [s.spec.k_max for s in self._running_seqs(request_id)] if request_id is not None else []
        for k_max in named or [K_MAX_LIMIT]:
            SpecParams(k=k, k_max=k_max)

        def change() -> None:
            seqs = self._running_seqs(request_id)
            # every live request: k up to its own k_max; one request: its k_max's range check, before any change
            # (so a refusal changes no request)
            clamp = request_id is None and k is not None
            specs = [
                SpecParams(drafter=s.spec.drafter, k=min(k, s.spec.k_max) if clamp else k, k_max=s.spec.k_max)
                for s in seqs
            ]
            for seq, spec in zip(seqs, specs, strict=True):
                seq.spec = spec
                drafter = self.drafter(seq.spec.drafter)
                seq.adaptive = _controller(seq.spec.k_max, drafter, seq.sampling) if k is None else None
                seq.k = (
                    seq.adaptive.next_k()
                    if seq.adaptive is not None
                    else _start_k(spec.k, seq.spec.k_max, drafter, seq.sampling)
                )

        self.apply(change)

    def set_drafter(self, name: str, request_id: int | None = None) -> None:
        """Switch the drafter of one request (or all live ones) from the next step on."""
        name = self._drafter_name(name)
        drafter = self.drafter(name)  # unknown names fail here, in the caller

        def change() -> None:
            for seq in self._running_seqs(request_id):
                self.drafters.release(seq)
                seq.spec = SpecParams(drafter=name, k=seq.spec.k, k_max=seq.spec.k_max)
                had = seq.adaptive is not None
                if seq.spec.k is None:  # what it learnt was another drafter's acceptance (or none, from `none`)
                    seq.adaptive = _controller(seq.spec.k_max, drafter, seq.sampling)
                if seq.spec.k is not None or not had or seq.adaptive is None:  # an adaptive k stays till the next step
                    seq.k = _start_k(seq.spec.k, seq.spec.k_max, drafter, seq.sampling)
            if request_id is None:
                self.metrics.observe_drafter_switch()

        self.apply(change)

    def set_kv(self, fmt: str) -> None:
        """Switch the KV page format (bf16 | fp16 | fp32 | mxfp4 | k8v4), converting live conversations in place.

        Runs between steps, like `apply`, but in the caller, so that a switch the memory budget cannot hold
        (live requests need more pages than the new format fits) raises KVCacheFullError here and changes nothing.
        """
        if fmt not in KV_FORMATS:
            raise ConfigError(f"kv format must be one of {', '.join(KV_FORMATS)}, got {fmt!r}")
        with self._callers_kernel_work(), self._lock:
            self._drain_commands()
            self.spec_step.drop_ahead()  # (its step reserved room in the pages about to be converted)
            self.pool.convert(fmt)
            self.spec_step.invalidate()

    def resolve_formats(self, weights: str = "auto", kv: str = "auto") -> tuple[str, str]:
        """The (weights, KV page format) that settings mean on this model: "auto" weights are the form its file
        stores (mxfp4 for an MXFP4 checkpoint, else bf16), "auto" KV the pool's (`kv_pages.auto_format`)."""
        if weights == "auto":
            weights = "mxfp4" if self.weights.sources.checkpoint else "bf16"
        if kv == "auto":
            kv = auto_format(model_dtype(self.model), self.pool.cpu_kernels, self.pool.head_dim)
        return weights, kv

    def set_weights(self, fmt: str, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Switch the weights between "bf16" (unquantized, the model dtype) and "mxfp4" between steps.

        The first switch of a model to MXFP4 computes its GPTQ checkpoint (quant.handler, minutes on a CPU;
        `progress` hears ("GPTQ", linears done, linears)) on the calling thread while the engine goes on serving;
        the swap then runs between two steps, in the caller like `set_kv`, so that its error is raised here.
        Running requests continue: their KV cache is kept, only the next steps use the new weights; cached
        prefixes of finished requests are dropped.
        """
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
        with self._callers_kernel_work():
            self.weights.prepare(fmt, progress)
            with self._lock:
                self._drain_commands()
                switched = fmt != self.weights.current
                self.weights.set(fmt)
                sources = self.weights.sources
                if switched and fmt == "bf16" and self.pool.cpu_kernels and sources.model_path is not None:
                    # the dense linears read back from the file: the CPU kernels' GGUF blocks (a bf16 model's
                    # Bf16Linear) again, as at load
                    pack_cpu_weights(self.model, sources.model_path, sources.dense_file, self.config.cpu_act)
                if switched and fmt == "mxfp4" and self.pool.cpu_kernels:  # --cpu-act's rows for the MXFP4 linears
                    use_cpu_rows(self.model, self.config.cpu_act)
                if switched and isinstance(self.model, FusedTransformer):  # the switch's dense linears are plain ones
                    fuse_linears(self.model)
                if switched and self.pool.cpu_kernels:  # the old weights go now, not at the next step's binding
                    cpu_fusion.unbind(self.model)
                self.pool.clear_prefix_cache()  # cached prefixes hold keys/values computed with the other weights
                if switched:  # drafters with weights of their own (EAGLE-3 heads) take the same form
                    self.drafters.follow_weights(fmt)
                    self.spec_step.invalidate()
            if self.device.type == "cpu":
                cpu_build.release_free_memory()  # (their pages back to the system)

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
            self.spec_step.drop_ahead()  # a step launched ahead ran on what the command may change
            try:
                command()
            except Exception as exc:  # delivered to whoever waits on the Future
                done.set_exception(exc)
            else:
                done.set_result(None)

    # --- the step loop ----------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One step: schedule -> speculation step (draft, forward, verify) -> postprocess; deliver the events."""
        with self._lock:
            self._drain_commands()
            plan, events = self.scheduler.schedule()
            if plan.items:
                try:
                    run = self.spec_step.run
                    result = run(plan) if self.governor is None else self.governor.step(run, plan)
                    events += self.scheduler.postprocess(plan, result)
                except Exception as exc:  # a bug or a device error: the step's requests fail, the engine goes on
                    log.exception("engine step failed; its requests end with an error")
                    self.spec_step.drop_ahead()
                    events += self.scheduler.fail(plan, f"{STEP_FAILED}: {type(exc).__name__}: {exc}")
        self._deliver(events)
        return events

    def _deliver(self, events: list[Event]) -> None:
        """Events to the metrics, to their requests' handles, then to the listeners."""
        with self._lock:
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

    @property
    def running_in_background(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Run the step loop in a background thread from now on (on the CPU, the calling thread's OpenMP workers
        end first: `cpu_build.release_openmp_threads` says why)."""
        if self._thread is None:
            self.release_caller_threads()
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="specchat-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.scheduler.has_work() and self._commands.empty():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # outside any one request's step (a bug): end what is live, keep the loop
                log.exception("engine loop error; live requests end with an error")
                self._deliver_guarded(self.scheduler.fail_all(f"{LOOP_FAILED}: {type(exc).__name__}: {exc}"))

    def _deliver_guarded(self, events: list[Event]) -> None:
        """`_deliver` where a listener that raises must not end the caller (the step loop, `close`): the handles
        have their events by then; the error is logged."""
        try:
            self._deliver(events)
        except Exception:
            log.exception("a listener failed while live requests were ended")

    def close(self) -> None:
        """Stop the background step loop. Requests still live end now with ENGINE_CLOSED, keeping what each wrote
        (no thread steps for them any more). The engine stays usable as before `start()`: a later request is
        stepped by the thread that reads its events."""
        if self._thread is not None and self._thread is threading.current_thread():
            raise ConfigError("close() from the engine's own step loop (a listener): call it from another thread")
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()
            with self._lock:  # (the thread cleared under the lock: a caller's step starts after the requests end)
                self._thread = None
                self._drain_commands()  # (changes queued for the loop: a cancel, say)
                self.spec_step.drop_ahead()
                events = self.scheduler.fail_all(ENGINE_CLOSED)
            self._deliver_guarded(events)

    # --- accounting -------------------------------------------------------------------------------------------
    def reset_metrics(self, whole_run: bool = False) -> None:
        """Start the engine-wide aggregates afresh (benchmarks measure one phase at a time); `whole_run`: latency
        percentiles over every sample from now on, not only the newest (EngineMetrics.latency_window)."""
        with self._lock:
            self.metrics = EngineMetrics(latency_window=None) if whole_run else EngineMetrics()

    def snapshot(self) -> Snapshot:
        """Speculation, throughput, latency, queue depth and memory, now (engine.telemetry's definitions)."""
        with self._lock:
            return self.metrics.snapshot(len(self.scheduler.running), len(self.scheduler.waiting), self.memory())

    def memory(self) -> dict:
        """Bytes of weights and KV cache, and what they would be in bf16 (quant.handler, engine.kv_cache)."""
        return {**self.weights.memory(), **self.pool.memory(self.model.cfg.max_position)}


def _past_context(tokens: str, limit: int) -> str:
    """Why a prompt of `tokens` tokens ("9000", "at least 9000") is refused by a context of `limit`."""
    return (
        f"prompt is {tokens} tokens; the model's context holds {limit}, a prompt at most {limit - 1} "
        "(one position is left for the answer)"
    )


def _gated_k(drafter: Drafter, sampling: SamplingParams) -> int | None:
    """The k a self-gated drafter drafts up to for this request (Drafter.gated_k): greedy requests only (the
    packed heads gate their greedy chain; sampled drafts are not gated and keep the adaptive controller)."""
    return drafter.gated_k if sampling.greedy else None


def _controller(k_max: int, drafter: Drafter, sampling: SamplingParams) -> AdaptiveK | None:
    """A fresh adaptive-K controller for a request of `drafter` (its draft sources; its own gate's k, if any); none
    for `none`, which drafts nothing at any k: with one, its batches were draft-gated, and a step the gate allows
    to draft cannot run ahead on CUDA graphs, drafts or not (the bench's plain baseline under --k auto ran 3-6% of
    its steps under caps 1-4, timed at 1.14-1.34 ms a token against 0.75 for its plain steps; H100, fortieth
    session)."""
    if isinstance(drafter, NoDrafter):
        return None
    return AdaptiveK.for_sources(k_max, drafter.sources, _gated_k(drafter, sampling))


def _start_k(k: int | None, k_max: int, drafter: Drafter, sampling: SamplingParams) -> int:
    """A request's k as it starts or changes drafter: a fixed k as given; an adaptive one, before its controller
    has learnt anything, 4 (or its drafter's own gate's k) up to k_max; 0 under `none`, which drafts nothing at any
    k (a request of `none` at k > 0 kept the batch's adaptive requests from their draft gate, and asked for taps)."""
    if isinstance(drafter, NoDrafter):
        return 0
    return k if k is not None else min(_gated_k(drafter, sampling) or 4, k_max)
