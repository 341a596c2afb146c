"""Live settings: the Controls panel and the key bindings change K, drafter, weights, KV and temperature.

K and temperature apply at once (K through `engine.set_k`, from the next step; temperature from the next
message). Drafter, weights and KV call the engine's setter in a worker thread, since loading a drafter or
quantizing takes a while; a refusal becomes a notification and the control snaps back. A first switch of a model
to MXFP4 weights quantizes it (GPTQ, minutes on a CPU): the app says so, with a rough time, before it starts, shows
the time left as it goes, and Esc stops it. While the model loads, a drafter picked is what the first requests
get; weights and KV wait for the model. Every change gives the keyboard back to the chat's prompt. An agent script
that asks for other formats switches them the same way (`switch_settings`), and starts once they all succeeded.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial

from specchat.config import DRAFTERS, SpecParams, check_drafter_name
from specchat.errors import ConfigError, SpecchatError
from specchat.registry import ModelSpec, resolve
from specchat.ui.controls import ControlsPanel, k_text
from specchat.ui.memory import MemoryPanel
from specchat.ui.messages import SettingApplied, SettingProgress
from specchat.ui.speculation import SpeculationPanel

K_ACTIONS = ("k_up", "k_down", "k_auto")  # nothing to do without a drafter: shown disabled then
# GPTQ's cost in core-seconds per linear weight: the default model's first MXFP4 switch quantized its 134.5M linear
# weights in 165 s on 2 idle cores (2026-12-06); on a busy machine it took up to ~45 min (docs/quantization.md)
GPTQ_CORE_S_PER_WEIGHT = 2 * 165 / 134.5e6


def duration_text(seconds: float) -> str:
    """'under a minute', '~3 min'."""
    return "under a minute" if seconds < 60 else f"~{round(seconds / 60)} min"


def gptq_seconds(memory: dict, device: str | None) -> float | None:
    """Roughly how long a first MXFP4 switch's GPTQ takes here on an idle machine; None off the CPU (not measured)."""
    if device != "cpu":
        return None
    weights = memory.get("linear_weight_bytes_bf16", 0) / 2
    return weights * GPTQ_CORE_S_PER_WEIGHT / (os.cpu_count() or 1)


@dataclass(slots=True)
class Quantizing:
    """A first switch to MXFP4 weights under way (GPTQ into the model's cache); `stop` ends it."""

    started: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class SwitchBatch:
    """Drafter / weights / KV changes started together for one purpose (an agent script's formats): `then` runs once
    every one has succeeded; otherwise one notification, headed `failed`, says what went wrong and what did change."""

    pending: set[str]
    then: Callable[[], Awaitable[None] | None]
    failed: str
    problems: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    stopped_only: bool = True  # every problem was a quantization the user stopped (Esc): not an error


def model_drafter(name: str, model: ModelSpec | str | None, device: str | None = None) -> str:
    """`default` -> the drafter models.toml names for the model on `device` ("cpu" | "cuda"; None: not known yet):
    a loaded model's entry (None: not in models.toml), or a model name to look up before loading (a bad one gives
    `none`, and the load says why). Where the default depends on the device and the device is not known yet, it
    stays `default` (the engine resolves it; the app names it once the model is loaded). Other names as they are."""
    if name != "default":
        return name
    if isinstance(model, str):
        try:
            model = resolve(model)
        except SpecchatError:
            return "none"
    if model is None:
        return "none"
    if device is None and model.default_drafter_varies():
        return "default"
    return model.default_drafter(device)


def engine_device(engine) -> str | None:
    """The device type a loaded engine runs on ("cpu" | "cuda"), None where it does not say (test stand-ins)."""
    device = getattr(engine, "device", None)
    return getattr(device, "type", None)


def drafter_description(name: str, model_spec: ModelSpec | None) -> str:
    """The drafter as the Speculation panel names it; for draft-model, which model drafts."""
    kind, _, arg = name.partition(":")
    if kind != "draft-model":
        return name
    try:
        draft = resolve(arg or None)
    except SpecchatError:
        return name
    if model_spec is not None and draft.where == model_spec.where:
        return f"{name}: {draft.alias}, the model itself (a check: no speed-up)"
    return f"{name}: {draft.alias} drafts"


@dataclass(slots=True)
class ChatSettings:
    """What new requests get, and what the Controls panel shows."""

    k: int | None
    drafter: str
    temperature: float
    weights: str | None = None  # None = as loaded
    kv: str | None = None
    system: str | None = None  # the system prompt new chats start with


class LiveSettings:
    """The settings half of SpecchatApp (a mixin: it uses the app's engine, bridge, metrics and widgets)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.switching: dict[str, str] = {}  # drafter / weights / kv changes on their way: name -> value
        self.quantizing: Quantizing | None = None
        self.switch_batches: list[SwitchBatch] = []  # changes an agent script waits for
        self.failed_drafter: str | None = (
            None  # the drafter last asked for, if it could not be built: F2 goes on from it
        )

    def on_controls_panel_changed(self, message: ControlsPanel.Changed) -> None:
        """A control was used: apply it, and give the keyboard back to the chat (Enter must not press the button
        again, and the next message typed must land in the prompt)."""
        self.change_setting(message.name, message.value)
        self.focus_prompt()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """K's keys are shown disabled while no drafter drafts."""
        if action in K_ACTIONS and self.settings.drafter == "none":
            return None
        return True

    def show_drafter(self) -> None:
        """Name the drafter in the Speculation panel (which model drafts, for draft-model) and the K control's state."""
        spec = self.engine.model_spec if self.engine is not None else None
        if (panel := self.widget(SpeculationPanel)) is not None:
            panel.drafter = drafter_description(self.settings.drafter, spec)
        if (controls := self.widget(ControlsPanel)) is not None:
            controls.show("drafter", self.settings.drafter)
        self.refresh_bindings()
        self.show_welcome()

    def change_setting(self, name: str, value: str) -> None:
        """Apply a setting: K and temperature at once, drafter / weights / KV in a worker thread."""
        controls = self.main.query_one(ControlsPanel)
        if name == "k":
            try:
                k = None if value == "auto" else int(value)
                SpecParams(drafter=self.settings.drafter, k=k, k_max=self.k_max)
            except (ValueError, ConfigError) as exc:
                reason = str(exc) if isinstance(exc, ConfigError) else f"K must be an integer or 'auto', got {value!r}"
                self.notify(reason, severity="error")
                controls.show("k", k_text(self.settings.k))
                return
            self.settings.k = k
            if self.engine is not None:
                self.engine.set_k(k)
            controls.show("k", k_text(k))
            self.show_welcome()
        elif name == "temperature":
            try:
                temperature = replace(self.sampling, temperature=float(value)).temperature
            except (ValueError, ConfigError) as exc:
                self.notify(f"temperature: {exc}", severity="error")
                controls.show("temperature", str(self.settings.temperature))
                return
            self.settings.temperature = temperature
            controls.show("temperature", str(temperature))
            self.notify(f"temperature {temperature}: from the next message on", timeout=3)
        elif self.bridge is None and name == "drafter":
            try:
                self.settings.drafter = check_drafter_name(value)
            except ConfigError as exc:
                self.notify(str(exc), severity="error")
            self.show_drafter()
        else:
            if (refusal := self.switch_refusal(name)) is not None:
                self.notify(f"{name}: {refusal}", severity="warning")
                if self.bridge is None:
                    controls.show(name, getattr(self.settings, name) or "")
                return
            self.start_switch(name, value)

    def switch_refusal(self, name: str) -> str | None:
        """Why a drafter / weights / KV change cannot start now (a second F3 while the first switch runs); None if
        it can."""
        if self.bridge is None:
            return "the model is still loading; change it once it is ready"
        if name not in self.switching:
            return None
        if name == "weights" and self.quantizing is not None:
            return "still quantizing to mxfp4 (Esc stops it)"
        return f"still switching to {self.switching[name]}; change it again once that is done"

    def still_changing(self, names, then: str) -> str | None:
        """'weights still changing: <then> once that is done' (with how to stop a quantization) while a change of
        `names` runs; None while none does."""
        changing = [name for name in names if name in self.switching]
        if not changing:
            return None
        stop = ", or Esc stops the quantization" if self.quantizing is not None else ""
        return f"{' and '.join(changing)} still changing: {then} once that is done{stop}"

    def start_switch(self, name: str, value: str) -> None:
        """Change drafter / weights / KV in a worker thread behind the Controls' progress bar; a first MXFP4 switch
        says first that it quantizes, and how long that takes, and Esc stops it. Its end is a SettingApplied."""
        controls = self.main.query_one(ControlsPanel)
        self.switching[name] = value
        controls.set_busy(True)
        stop = None
        if name == "weights" and value == "mxfp4" and self.reading().get("weights_mxfp4_needs_gptq"):
            self.quantizing = Quantizing()
            stop = self.quantizing.stop
            seconds = gptq_seconds(self.reading(), engine_device(self.engine))
            took = "minutes on the GPU" if seconds is None else f"{duration_text(seconds)} on this CPU when idle"
            self.notify(
                "weights → mxfp4: this model has no MXFP4 checkpoint yet, so it is quantized now (GPTQ), once: "
                f"the result is cached and later switches take a second. It takes {took}, longer while the "
                "machine is busy. The chats go on meanwhile; Esc stops it.",
                title="Quantizing to MXFP4",
                timeout=20,
            )
            took = "minutes" if seconds is None else duration_text(seconds)
            controls.show_note(f"quantizing to MXFP4, once: {took} · Esc stops")
        else:
            self.notify(f"{name} → {value}…", timeout=3)
        self.run_worker(partial(self.bridge.apply_setting, name, value, stop), thread=True, group="settings")

    def switch_settings(self, changes: dict[str, str], then: Callable[[], Awaitable[None] | None], failed: str) -> None:
        """Make several drafter / weights / KV changes as the Controls do, then call `then` once every one has
        succeeded. If one cannot start (another change of it runs), none starts; if one fails or is stopped, `then`
        never runs and one notification headed `failed` says why."""
        refusals = [f"{name}: {why}" for name in changes if (why := self.switch_refusal(name)) is not None]
        if refusals:
            self.notify(f"{failed}: {'; '.join(refusals)}", severity="warning", timeout=10)
            return
        if not changes:  # (the formats became the wanted ones meanwhile)
            self.call_later(then)
            return
        self.switch_batches.append(SwitchBatch(set(changes), then, failed))
        for name, value in changes.items():
            self.start_switch(name, value)

    def reading(self) -> dict:
        """The engine's memory figures as last read ({} before the first reading)."""
        panel = self.widget(MemoryPanel)
        return panel.memory if panel is not None else {}

    def controls_panel(self) -> ControlsPanel | None:
        """The Controls panel; None once the app is closing, its children torn down (a setting's progress or end
        still on its way then reached a panel without its fields, and quitting ended in a NoMatches traceback)."""
        controls = self.widget(ControlsPanel)
        return controls if controls is not None and controls.query("#switch-note") else None

    def cancel_quantizing(self) -> bool:
        """Stop a first MXFP4 switch's quantization (it ends after the linear in hand); False if none runs."""
        if self.quantizing is None or self.quantizing.stop.is_set():
            return False
        self.quantizing.stop.set()
        if (controls := self.controls_panel()) is not None:
            controls.show_note("stopping the quantization…")
        return True

    def on_unmount(self) -> None:
        """A quantization still running stops, so that quitting does not wait for it."""
        self.cancel_quantizing()

    def on_setting_progress(self, message: SettingProgress) -> None:
        controls = self.controls_panel()
        if controls is None:
            return
        controls.show_progress(message.done, message.total)
        quantizing = self.quantizing
        if quantizing is not None and not quantizing.stop.is_set() and message.done:
            left = (time.monotonic() - quantizing.started) * (message.total - message.done) / message.done
            controls.show_note(
                f"MXFP4 {message.what} {message.done}/{message.total} · {duration_text(left)} left · Esc stops"
            )

    def on_setting_applied(self, message: SettingApplied) -> None:
        self.switching.pop(message.name, None)
        controls = self.controls_panel()
        if message.name == "weights":
            self.quantizing = None
            if controls is not None:
                controls.show_note("")
        if controls is None:
            return
        controls.set_busy(bool(self.switching))  # another change still on its way keeps its progress bar
        batch = next((batch for batch in self.switch_batches if message.name in batch.pending), None)
        if message.name == "drafter":
            self.failed_drafter = message.value if message.error is not None else None
        if message.cancelled or message.error is not None:
            controls.show(message.name, getattr(self.settings, message.name) or "")
            problem = f"quantizing to {message.value} stopped; nothing changed" if message.cancelled else message.error
            if batch is not None:
                batch.problems.append(f"{message.name}: {problem}")
                batch.stopped_only &= message.cancelled
            elif message.cancelled:
                self.notify(f"{message.name}: {problem}", timeout=5)
            else:
                self.notify(f"{message.name}: {problem}", severity="error")
        else:
            setattr(self.settings, message.name, message.value)
            controls.show(message.name, message.value)
            if message.name == "drafter":
                self.show_drafter()
            self.show_welcome()
            self.request_reading()
            if batch is not None:
                batch.changed.append(f"{message.name} is now {message.value}")
            else:
                self.notify(f"{message.name} = {message.value}", timeout=3)
        if batch is not None:
            batch.pending.discard(message.name)
            if not batch.pending:
                self.switch_batches.remove(batch)
                self.end_batch(batch)

    def end_batch(self, batch: SwitchBatch) -> None:
        """Every change of the batch has ended: go on with `then`, or say in one notification why not."""
        if not batch.problems:
            self.call_later(batch.then)
            return
        changed = f" ({', '.join(batch.changed)})" if batch.changed else ""
        severity = "warning" if batch.stopped_only else "error"
        self.notify(f"{batch.failed}: {'; '.join(batch.problems)}{changed}", severity=severity, timeout=10)

    def action_k_up(self) -> None:
        """One more draft token per step."""
        current = self.settings.k if self.settings.k is not None else (self.metrics.k_next or 0)
        self.change_setting("k", str(min(current + 1, self.k_max)))

    def action_k_down(self) -> None:
        """One draft token fewer per step."""
        current = self.settings.k if self.settings.k is not None else (self.metrics.k_next or 0)
        self.change_setting("k", str(max(current - 1, 0)))

    def action_k_auto(self) -> None:
        """Let the adaptive controller pick K."""
        self.change_setting("k", "auto")

    def action_next_drafter(self) -> None:
        """Switch to the next drafter: the one after the drafter in use, or after the last one asked for if it could
        not be built (a model without trained heads: F2 asked for `heads` again and again, and never reached the
        drafters after it)."""
        names = DRAFTERS
        last = self.failed_drafter or self.settings.drafter
        current = names.index(last) if last in names else -1
        self.change_setting("drafter", names[(current + 1) % len(names)])

    def action_toggle_weights(self) -> None:
        """Weights MXFP4 <-> bf16."""
        self.change_setting("weights", "bf16" if self.settings.weights == "mxfp4" else "mxfp4")

    def action_toggle_kv(self) -> None:
        """KV cache MXFP4 <-> bf16."""
        self.change_setting("kv", "bf16" if self.settings.kv == "mxfp4" else "mxfp4")
