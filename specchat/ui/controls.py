"""The Controls panel: K, drafter, weight and KV formats, temperature. Edits go to the app as one message."""

from __future__ import annotations

from textual import on
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Button, Input, Label, ProgressBar, Select

from specchat.config import KV_FORMATS, WEIGHT_FORMATS


def k_text(k: int | None) -> str:
    return "auto" if k is None else str(k)


class ControlsPanel(Vertical):
    """Live settings; the app applies them and calls `show()` with what took effect."""

    class Changed(Message):
        """The user asked for a setting: name is k | drafter | weights | kv | temperature; value is text."""

        def __init__(self, name: str, value: str) -> None:
            super().__init__()
            self.name = name
            self.value = value

    def __init__(self, k: int | None, drafter: str, drafters: tuple[str, ...], temperature: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k
        self.drafter = drafter
        self.drafters = drafters if drafter in drafters else (*drafters, drafter)
        self.temperature = temperature

    def compose(self):
        with Horizontal(classes="row", id="k-row"):
            yield Label("K", classes="name")
            yield Input(k_text(self.k), id="k-input", compact=True, classes="k-field")
            yield Button("-", id="k-down", compact=True)
            yield Button("+", id="k-up", compact=True)
            yield Button("auto", id="k-auto", compact=True)
        with Horizontal(classes="row"):
            yield Label("drafter", classes="name")
            yield Select(
                [(d, d) for d in self.drafters], value=self.drafter, allow_blank=False, id="drafter", compact=True
            )
        yield Label("K idle: no drafter (F2 picks one)", id="k-hint")
        with Horizontal(classes="row"):
            yield Label("weights", classes="name")
            yield Select([(f, f) for f in WEIGHT_FORMATS], prompt="as loaded", id="weights", compact=True)
        with Horizontal(classes="row"):
            yield Label("KV", classes="name")
            yield Select([(f, f) for f in KV_FORMATS], prompt="as loaded", id="kv", compact=True)
        with Horizontal(classes="row"):
            yield Label("temp", classes="name")
            yield Input(str(self.temperature), id="temperature", compact=True, classes="temp-field")
        yield Label(id="switch-note")

    def on_mount(self) -> None:
        self.border_title = "Controls"
        self.show_k_state()
        self.show_note("")

    def show_k_state(self) -> None:
        """K's row is disabled, with a hint, while no drafter drafts."""
        self.query_one("#k-row").disabled = self.drafter == "none"
        self.query_one("#k-hint").display = self.drafter == "none"

    @on(Button.Pressed, "#k-down")
    def on_k_down(self) -> None:
        """K - 1."""
        self.post_message(self.Changed("k", str(max((self.k if self.k is not None else 4) - 1, 0))))

    @on(Button.Pressed, "#k-up")
    def on_k_up(self) -> None:
        """K + 1."""
        self.post_message(self.Changed("k", str((self.k if self.k is not None else 4) + 1)))

    @on(Button.Pressed, "#k-auto")
    def on_k_auto(self) -> None:
        """Adaptive K."""
        self.post_message(self.Changed("k", "auto"))

    @on(Input.Submitted, "#k-input")
    def on_k_submitted(self, event: Input.Submitted) -> None:
        """K typed into the field."""
        self.post_message(self.Changed("k", event.value.strip()))

    @on(Input.Submitted, "#temperature")
    def on_temperature_submitted(self, event: Input.Submitted) -> None:
        """Temperature typed into the field."""
        self.post_message(self.Changed("temperature", event.value.strip()))

    @on(Select.Changed)
    def on_select_changed(self, event: Select.Changed) -> None:
        """Drafter, weights or KV picked (the drafter Select also reports its first value as it mounts: not a pick)."""
        if event.value is Select.BLANK or (event.select.id == "drafter" and event.value == self.drafter):
            return
        self.post_message(self.Changed(event.select.id, str(event.value)))

    def show(self, name: str, value: str) -> None:
        """Reflect a setting that took effect (without posting it again); "" = as loaded."""
        if name == "k":
            self.k = None if value == "auto" else int(value)
            self.query_one("#k-input", Input).value = value
        elif name == "temperature":
            self.temperature = float(value)
            self.query_one("#temperature", Input).value = value
        else:
            select = self.query_one(f"#{name}", Select)
            choices = {"drafter": self.drafters, "weights": WEIGHT_FORMATS, "kv": KV_FORMATS}[name]
            with self.prevent(Select.Changed):
                if value in choices:
                    select.value = value
                else:  # "as loaded", or a format the panel does not offer (fp16 / fp32 KV)
                    select.clear()
            if name == "drafter":
                self.drafter = value
                self.show_k_state()

    def set_busy(self, busy: bool) -> None:
        """Show an indeterminate bar while a long change (quantizing, loading a drafter) runs."""
        bars = self.query(ProgressBar)
        if busy and not bars:
            self.mount(ProgressBar(total=None, show_eta=False, show_percentage=False), before="#switch-note")
        elif not busy:
            bars.remove()
            self.show_note("")

    def show_note(self, note: str) -> None:
        """A line under the bar saying what the long change does (a first MXFP4 switch: quantizing, time left);
        "" hides it."""
        label = self.query_one("#switch-note", Label)
        label.update(Content(note))
        label.display = bool(note)

    def show_progress(self, done: int, total: int) -> None:
        """Turn the busy bar into a measured one: `done` of `total` (GPTQ's linears on a first MXFP4 switch)."""
        for bar in self.query(ProgressBar):
            bar.update(total=total, progress=done)
