"""The app's side of the engine: loading with progress, one message per step, setters that never crash the UI.

The UI reads the engine only through engine.api.ChatEngine: its step events (for the text), `snapshot()` (for
every figure) and its setters.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial

from textual.app import App

from specchat.config import EngineConfig
from specchat.engine.api import ChatEngine
from specchat.errors import SpecchatError
from specchat.ui.messages import EngineReading, EngineStep, LoadProgress, SettingApplied, SettingProgress


def load_engine(config: EngineConfig, progress: Callable[[str, int, int], None]) -> ChatEngine:
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
    """Resident memory of this process (Linux /proc; elsewhere the peak from getrusage; None where neither is, as
    on Windows, which has no `resource` module: the panel shows n/a)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def gpu_bytes(engine: ChatEngine) -> int | None:
    """Memory torch holds on the engine's GPU, or None on CPU."""
    if engine.device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.memory_reserved(engine.device))


class SwitchStopped(Exception):
    """Raised from a weight switch's progress callback to end its quantization: the user stopped it."""


class EngineBridge:
    """Connects one engine to one app: step events in, settings out."""

    def __init__(self, engine: ChatEngine, app: App) -> None:
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
        """Ask for the engine's figures; they come back as an EngineReading, read between two steps on the
        engine's thread (snapshot() takes the engine lock, which the UI thread must never wait on)."""
        self.engine.apply(self.post_reading)

    def post_reading(self) -> None:
        snapshot = self.engine.snapshot()
        memory = {**snapshot.memory, "rss_bytes": rss_bytes(), "gpu_bytes": gpu_bytes(self.engine)}
        self.app.post_message(EngineReading(snapshot, memory))

    def apply_setting(self, name: str, value: str, stop: threading.Event | None = None) -> None:
        """Worker thread: call the engine's setter (it may take long: quantizing, loading a drafter). Once `stop` is
        set, a weight switch's quantization ends at its next progress report (GPTQ: after the linear in hand),
        changing nothing."""

        def progress(what: str, done: int, total: int) -> None:
            if stop is not None and stop.is_set():
                raise SwitchStopped
            self.app.post_message(SettingProgress(what, done, total))

        setter = {
            "drafter": self.engine.set_drafter,
            "weights": partial(self.engine.set_weights, progress=progress),
            "kv": self.engine.set_kv,
        }
        try:
            setter[name](value)
            error = None
        except SwitchStopped:
            self.app.post_message(SettingApplied(name, value, cancelled=True))
            return
        except SpecchatError as exc:
            error = str(exc)
        except Exception as exc:  # our bug, but the chat must go on: log it, show one line
            self.app.log.error(traceback.format_exc())
            error = f"{type(exc).__name__}: {exc}"
        self.app.post_message(SettingApplied(name, value, error))
