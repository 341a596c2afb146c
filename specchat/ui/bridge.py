"""The app's side of the engine: loading with progress, one message per step, setters that never crash the UI.

The UI reads the engine only through its events, `memory()`, `snapshot()` (when the engine has it) and its
setters. Features that a given engine build lacks are detected here and reported as a line for the user.
"""

from __future__ import annotations

import os
import resource
import time
import traceback
from collections.abc import Callable

from textual.app import App

from specchat.config import EngineConfig
from specchat.errors import SpecchatError
from specchat.ui.messages import EngineReading, EngineStep, LoadProgress, SettingApplied

SETTERS = {"drafter": "set_drafter", "weights": "set_weights", "kv": "set_kv"}
KNOWN_DRAFTERS = ("none", "ngram", "heads", "draft-model")


def load_engine(config: EngineConfig, progress: Callable[[str, int, int], None]):
    """Fetch the model if needed (pip runs quietly: the terminal belongs to the UI), then load it."""
    from specchat.engine.engine import Engine
    from specchat.registry import fetch, resolve

    fetch(resolve(config.model), progress=progress)
    return Engine.load(config, progress=progress)


class ProgressPoster:
    """A loader progress callback that posts a message to the app when the shown percentage changes."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.last: tuple[str, int] | None = None

    def __call__(self, what: str, done: int, total: int) -> None:
        key = (what, 100 * done // total if total else -1)
        if key != self.last:
            self.last = key
            self.app.post_message(LoadProgress(what, done, total))


def rss_bytes() -> int | None:
    """Resident memory of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


def gpu_bytes(engine) -> int | None:
    """Memory torch holds on the engine's GPU, or None on CPU."""
    device = getattr(engine, "device", None)
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_reserved(device))


def drafter_names() -> tuple[str, ...]:
    """The drafter names the engine knows (its own list when it publishes one)."""
    from specchat.engine import drafters

    published = getattr(drafters, "DRAFTERS", None) or getattr(drafters.base, "DRAFTERS", None)
    if isinstance(published, str):  # "none | ngram | heads[:FILE] | ..."
        published = [name.split("[")[0].strip() for name in published.split("|")]
    return tuple(published) if published else KNOWN_DRAFTERS


def snapshot_figures(snap) -> dict:
    """engine.snapshot() -> the MetricsView fields it provides (None where nothing was measured yet)."""
    measured = snap.tokens_total > 0
    return {
        "tok_per_s": snap.tok_per_s if measured else None,
        "itl_p50_ms": snap.latency_p50_ms if measured else None,
        "itl_p99_ms": snap.latency_p99_ms if measured else None,
        "active_requests": snap.running,
        "queue_depth": snap.waiting,
    }


class EngineBridge:
    """Connects one engine to one app: step events in, settings out."""

    def __init__(self, engine, app: App) -> None:
        self.engine = engine
        self.app = app
        self.started_thread = False

    def attach(self) -> None:
        """Listen to the engine's steps and run its step loop in the background."""
        self.engine.listeners.append(self.on_step)
        if not self.engine.running_in_background:
            self.engine.start()
            self.started_thread = True

    def detach(self) -> None:
        """Stop listening; stop the step loop if this bridge started it."""
        if self.on_step in self.engine.listeners:
            self.engine.listeners.remove(self.on_step)
        if self.started_thread:
            self.engine.close()
            self.started_thread = False

    def on_step(self, events: list) -> None:
        """Engine thread: one non-blocking post per step, whatever the number of tokens."""
        self.app.post_message(EngineStep(events, time.perf_counter()))

    def request_reading(self) -> None:
        """Ask for memory (and snapshot) figures; they come back as an EngineReading, read between two steps
        on the engine's thread (snapshot() takes the engine lock, which the UI thread must never wait on)."""
        apply = getattr(self.engine, "apply", None)
        if apply is None:
            self.post_reading()
        else:
            apply(self.post_reading)

    def post_reading(self) -> None:
        memory, figures = {}, None
        try:
            snapshot = getattr(self.engine, "snapshot", None)
            if snapshot is None:
                memory = dict(self.engine.memory())
            else:
                snap = snapshot()
                memory, figures = dict(snap.memory), snapshot_figures(snap)
        except Exception as exc:  # shown in the panel; the engine keeps running
            memory = {"error": f"{type(exc).__name__}: {exc}"}
        memory.setdefault("rss_bytes", rss_bytes())
        memory.setdefault("gpu_bytes", gpu_bytes(self.engine))
        self.app.post_message(EngineReading(memory, figures))

    def has_setter(self, name: str) -> bool:
        return hasattr(self.engine, SETTERS[name])

    def apply_setting(self, name: str, value: str) -> None:
        """Worker thread: call the engine's setter (it may take long: quantizing, loading a drafter)."""
        setter = getattr(self.engine, SETTERS[name], None)
        if setter is None:
            error = f"this engine has no {SETTERS[name]}() yet"
        else:
            try:
                setter(value)
                error = None
            except SpecchatError as exc:
                error = str(exc)
            except Exception as exc:  # our bug, but the chat must go on: log it, show one line
                self.app.log.error(traceback.format_exc())
                error = f"{type(exc).__name__}: {exc}"
        self.app.post_message(SettingApplied(name, value, error))
