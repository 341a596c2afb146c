"""A synthetic engine for the UI (engine.api.ChatEngine), for UI tests and the responsiveness benchmark.

It streams TextDelta / StepEvent / Finished events from a thread at a fixed rate, through `listeners` exactly
as the engine does (one call per step), and folds them into the engine's own EngineMetrics for `snapshot()`,
so the app's whole path is exercised without a model's compute.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future

import torch

from specchat.engine.sequence import Finished, StepEvent, TextDelta
from specchat.engine.stats import SpecStats, StepRecord
from specchat.engine.telemetry import EngineMetrics, Snapshot

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "`code`",
    "and",
    "**bold**",
    "words",
    "stream",
    "past",
]


class FakeHandle:
    """Events reach the listeners only (as a TUI chat's do)."""

    def __init__(self, engine: FakeEngine, request_id: int) -> None:
        self.engine = engine
        self.request_id = request_id

    def events(self):
        raise RuntimeError("the fake engine's events go to its listeners")

    def result(self) -> Finished:
        raise RuntimeError("the fake engine's events go to its listeners")

    def cancel(self) -> None:
        self.engine.cancel(self.request_id)


class FakeEngine:
    """Emits `tokens_per_step` tokens per step at `steps_per_s`, `total_tokens` per request."""

    model_spec = None
    device = torch.device("cpu")

    def __init__(self, steps_per_s: float = 200.0, tokens_per_step: int = 1, total_tokens: int = 2000) -> None:
        self.steps_per_s = steps_per_s
        self.tokens_per_step = tokens_per_step
        self.total_tokens = total_tokens
        self.listeners: list = []
        self.running_in_background = False
        self.ids = itertools.count(1)
        self.cancelled: set[int] = set()
        self.threads: list[threading.Thread] = []
        self.k = 3
        self.last_post: float | None = None
        self.metrics = EngineMetrics()
        self.lock = threading.Lock()
        self.settings: dict[str, str] = {}

    def start(self) -> None:
        self.running_in_background = True

    def close(self) -> None:
        self.cancelled.update(range(1, 1000))
        for thread in self.threads:
            thread.join()
        self.running_in_background = False

    def submit(self, messages, sampling=None, spec=None, *, listen_only: bool = False) -> FakeHandle:
        request_id = next(self.ids)
        with self.lock:
            self.metrics.observe_submit(request_id)
        thread = threading.Thread(target=self.stream, args=(request_id,), daemon=True)
        self.threads.append(thread)
        thread.start()
        return FakeHandle(self, request_id)

    def stream(self, request_id: int) -> None:
        """Post one list of events per step, paced by wall clock (like a real engine's steps)."""
        stats, text, sent = SpecStats(), "", 0
        t0 = time.perf_counter()
        period = 1.0 / self.steps_per_s
        for step in itertools.count():
            if request_id in self.cancelled or sent >= self.total_tokens:
                break
            delay = t0 + step * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            n = min(self.tokens_per_step, self.total_tokens - sent)
            chunk = "".join(WORDS[(sent + i) % len(WORDS)] + " " for i in range(n))
            if (sent // 40) != ((sent + n) // 40):
                chunk += "\n\n"
            record = StepRecord(k=self.k, accepted=min(n - 1, self.k), emitted=n, draft_ms=0.1, verify_ms=period * 1e3)
            stats.observe_step(record)
            sent += n
            text += chunk
            self.post([StepEvent(request_id, record, self.k), TextDelta(request_id, chunk, list(range(n)))])
        reason = "cancelled" if request_id in self.cancelled else "length"
        self.post([Finished(request_id, reason, text, list(range(sent)), 8, stats, time.perf_counter() - t0, 1.0)])

    def post(self, events: list) -> None:
        self.last_post = time.perf_counter()
        with self.lock:
            self.metrics.observe_events(events, self.last_post)
        for listener in self.listeners:
            listener(events)

    def cancel(self, request_id: int) -> None:
        self.cancelled.add(request_id)

    def set_k(self, k: int | None, request_id: int | None = None) -> None:
        self.k = k or 0

    def set_drafter(self, name: str, request_id: int | None = None) -> None:
        self.settings["drafter"] = name
        with self.lock:
            self.metrics.observe_drafter_switch()

    def set_weights(self, fmt: str, progress=None) -> None:
        self.settings["weights"] = fmt

    def resolve_formats(self, weights: str = "auto", kv: str = "auto") -> tuple[str, str]:
        return ("bf16" if weights == "auto" else weights), ("bf16" if kv == "auto" else kv)

    def set_kv(self, fmt: str) -> None:
        self.settings["kv"] = fmt

    def apply(self, command) -> Future:
        """Runs the command at once (there is no step to wait for)."""
        done: Future = Future()
        command()
        done.set_result(None)
        return done

    def snapshot(self) -> Snapshot:
        with self.lock:
            running = sum(thread.is_alive() for thread in self.threads)
            return self.metrics.snapshot(running, 0, self.memory())

    def memory(self) -> dict:
        return {
            "weights_bytes": 270_000_000,
            "linear_weight_bytes": 230_000_000,
            "linear_weight_bytes_bf16": 230_000_000,
            "kv_format": "bf16",
            "kv_bytes_per_token": 23_040,
            "kv_bytes_per_token_bf16": 23_040,
            "kv_capacity_tokens": 46_603,
            "kv_used_tokens": 512,
            "max_context": 8192,
            "rss_bytes": 1_200_000_000,
        }
