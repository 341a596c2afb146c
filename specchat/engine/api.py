"""What the UI and the agent runner need of an engine, stated once.

engine.engine.Engine implements both protocols; so do the tests' stand-ins (tests/ui/fake_engine.py for the
UI, tests/agent/scripted_engine.py for agent loops), which is how the UI and the agent loop are tested without
a model. Nothing outside the engine reaches past these: the UI reads events, snapshots and memory, and
changes the engine only through the setters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from specchat.config import SamplingParams, SpecParams
from specchat.engine.sequence import Event, Finished
from specchat.engine.telemetry import Snapshot
from specchat.registry import ModelSpec

Prompt = str | list[dict] | list[int]


def weights_label(memory: dict, dtype: str | None = None) -> str:
    """The running weights named from an engine's memory(): the quantized format and how it was made, else the
    model dtype (`dtype` as asked with --dtype, else the engine's `weights_dtype`, else read off the bytes per
    weight: float32 and bfloat16 differ in width). memory() says "bf16" for any unquantized weights; linears read
    as a GGUF file's blocks on the CPU are named by their block types ("gguf Q4_1+Q8_0")."""
    fmt = memory.get("weights_format")
    if fmt and fmt != "bf16":
        method = memory.get("weights_method")
        return f"{fmt} ({method})" if method else str(fmt)
    if memory.get("weights_gguf"):
        return f"gguf {memory['weights_gguf']}"
    if dtype is not None or memory.get("weights_dtype"):
        return dtype or memory["weights_dtype"]
    linear, bf16 = memory.get("linear_weight_bytes"), memory.get("linear_weight_bytes_bf16")
    if not linear or not bf16:
        return str(fmt or "n/a")
    bits = 16 * linear / bf16
    return {32.0: "float32", 16.0: "bfloat16"}.get(round(bits, 2), f"{bits:.2f}-bit")


def named_weights(memory: dict, dtype: str | None = None) -> dict:
    """An engine's memory() with unquantized weights named by their dtype ("float32"), for JSON output (memory()
    says "bf16" for every unquantized form); `dtype` as for weights_label."""
    if memory.get("weights_format") != "bf16":
        return memory
    return {**memory, "weights_format": weights_label(memory, dtype)}


Listener = Callable[[list[Event]], None]  # called on the engine's thread with each step's events


@runtime_checkable
class Request(Protocol):
    """A submitted request."""

    request_id: int

    def events(self) -> Iterator[Event]:
        """The request's events, ending with one Finished."""
        ...

    def result(self) -> Finished: ...

    def cancel(self) -> None: ...


@runtime_checkable
class ChatEngine(Protocol):
    """The engine as the TUI sees it: requests, a stream of step events, live settings, figures."""

    model_spec: ModelSpec | None  # None: a model loaded from a path outside models.toml
    device: torch.device
    listeners: list[Listener]

    @property
    def running_in_background(self) -> bool: ...

    def start(self) -> None:
        """Run the step loop on the engine's own thread."""
        ...

    def close(self) -> None: ...

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        spec: SpecParams | None = None,
        *,
        listen_only: bool = False,
    ) -> Request:
        """Queue a request (bad parameters raise SpecchatError here); listen_only: events go to listeners only."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def set_k(self, k: int | None, request_id: int | None = None) -> None: ...

    def set_drafter(self, name: str, request_id: int | None = None) -> None: ...

    def set_weights(self, fmt: str, progress: Callable[[str, int, int], None] | None = None) -> None: ...

    def resolve_formats(self, weights: str = "auto", kv: str = "auto") -> tuple[str, str]:
        """(weights, KV page format) that "auto" settings mean on this model."""
        ...

    def set_kv(self, fmt: str) -> None: ...

    def apply(self, command: Callable[[], None]) -> Future:
        """Run `command` between two steps, on the engine's thread."""
        ...

    def snapshot(self) -> Snapshot:
        """Every live figure (engine.telemetry), read between steps."""
        ...

    def memory(self) -> dict: ...


@runtime_checkable
class AgentEngine(Protocol):
    """The engine as an agent loop sees it: prompts encoded with tools, requests, drafters, memory."""

    tokenizer: object  # engine.tokenizer.Tokenizer: encode(), chat_template_source

    def encode_prompt(self, prompt: Prompt, *, tools: list | None = None) -> list[int]:
        """Chat messages (with the tools' schemas, when given) -> prompt token ids, checked against the context."""
        ...

    def submit(
        self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecParams | None = None
    ) -> Request: ...

    def drafter(self, name: str) -> object:
        """Build (or fetch) a drafter now, so that a bad name fails before any request."""
        ...

    def memory(self) -> dict: ...


@runtime_checkable
class ServedEngine(ChatEngine, Protocol):
    """The engine as `specchat serve` sees it: a chat engine that also encodes prompts and knows its context."""

    tokenizer: object  # engine.tokenizer.Tokenizer: chat_template_source

    @property
    def max_position(self) -> int:
        """Tokens the model's context holds (prompt + completion)."""
        ...

    def encode_prompt(self, prompt: Prompt, system: str | None = None, raw: bool = False, tools=None) -> list[int]: ...

    def end_all(self, error: str) -> Future:
        """End every live request with `error`, keeping what each wrote (a stopping server)."""
        ...


def default_drafter_name(engine) -> str:
    """What a request's drafter `default` names on a loaded engine: its models.toml entry's drafter on its device
    (`none` outside models.toml; the engine and the server both ask)."""
    spec = getattr(engine, "model_spec", None)
    return spec.default_drafter(engine.device.type, engine.config.tp) if spec is not None else "none"
