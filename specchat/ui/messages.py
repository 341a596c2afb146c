"""Messages that cross from worker threads (engine loop, loader, setters) into the app."""

from __future__ import annotations

from textual.message import Message

from specchat.engine.sequence import Event
from specchat.engine.telemetry import Snapshot


class EngineStep(Message):
    """The events of one engine step (all requests), posted once per step from the engine thread."""

    def __init__(self, events: list[Event], time: float) -> None:
        super().__init__()
        self.events = events
        self.time = time


class LoadProgress(Message):
    """Fetching or loading the model moved on (total 0 = unknown)."""

    def __init__(self, what: str, done: int, total: int) -> None:
        super().__init__()
        self.what = what
        self.done = done
        self.total = total


class EngineReady(Message):
    """The model is loaded; the engine is passed over to the app."""

    def __init__(self, engine: object) -> None:
        super().__init__()
        self.engine = engine


class LoadFailed(Message):
    """The model could not be loaded; the error ends the app."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


class EngineReading(Message):
    """The engine's figures (engine.telemetry.Snapshot) and memory with the process's own; read between steps."""

    def __init__(self, snapshot: Snapshot, memory: dict) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.memory = memory


class SettingProgress(Message):
    """A long setting change reports how far it is: `done` of `total` steps of `what` (GPTQ: linears)."""

    def __init__(self, what: str, done: int, total: int) -> None:
        super().__init__()
        self.what = what
        self.done = done
        self.total = total


class SettingApplied(Message):
    """A live setting (drafter, weights, KV) finished changing, failed with `error`, or was `cancelled` (a weight
    switch's quantization stopped by the user: nothing changed)."""

    def __init__(self, name: str, value: str, error: str | None = None, cancelled: bool = False) -> None:
        super().__init__()
        self.name = name
        self.value = value
        self.error = error
        self.cancelled = cancelled
