"""The Speculation panel: which drafter, acceptance now and over time, tokens per step, per-position acceptance,
step time."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline, Static

from specchat.ui.figures import NA, FigureText, bar, num, pct
from specchat.ui.metrics import MetricsView

BAR = 12  # cells of a histogram bar


def drafter_line(drafter: str) -> Text:
    return Text.assemble("drafter      ", (drafter or NA, "bold"))


def headline(view: MetricsView) -> str:
    k_next = NA if view.k_next is None else str(view.k_next)
    drafted = NA if view.k_last is None else str(view.k_last)
    return (
        f"acceptance   [b]{pct(view.acceptance_now)}[/b]\n"
        f"tokens/step  [b]{num(view.tokens_per_step_now, 2)}[/b]\n"
        f"k next {k_next} · last step drafted {drafted}"
    )


def histogram(view: MetricsView) -> str:
    """Rows n = 1..k+1: share of steps that emitted n tokens."""
    hist = list(view.emitted_histogram[1:])
    rows = max(len(hist), (view.k_next or 0) + 1)
    hist += [0] * (rows - len(hist))
    total = sum(hist)
    lines = ["[dim]tokens emitted per step[/dim]"]
    for n, steps in enumerate(hist, start=1):
        share = steps / total if total else 0.0
        lines.append(f"{n:>2} {bar(share, BAR)} {pct(share) if total else NA:>4}")
    return "\n".join(lines)


def positions(view: MetricsView) -> str:
    """Row i: how often the i-th draft of a step was accepted."""
    lines = ["[dim]accepted by draft position[/dim]"]
    if not view.position_acceptance:
        lines.append(f" {NA} (no drafts yet)")
    for i, rate in enumerate(view.position_acceptance, start=1):
        lines.append(f"d{i:<2}{bar(rate, BAR)} {pct(rate):>4}")
    return "\n".join(lines)


def step_time(view: MetricsView) -> str:
    """Mean draft and verify milliseconds per step, as bars on one scale."""
    if view.draft_ms is None or view.verify_ms is None:
        return f"[dim]ms per step[/dim]\ndraft  {NA}\nverify {NA}"
    top = max(view.draft_ms, view.verify_ms, 1e-9)
    return (
        "[dim]ms per step[/dim]\n"
        f"draft  {bar(view.draft_ms / top, 8)} {view.draft_ms:6.1f}\n"
        f"verify {bar(view.verify_ms / top, 8)} {view.verify_ms:6.1f}"
    )


class SpeculationPanel(Vertical):
    """How much drafting pays off, live."""

    view: reactive[MetricsView] = reactive(MetricsView, init=False)
    drafter: reactive[str] = reactive("", init=False)  # as settings.drafter_description names it

    def compose(self):
        yield Static(drafter_line(self.drafter), classes="drafter")
        yield FigureText(headline(MetricsView()), classes="headline")
        yield Sparkline([], classes="acceptance-history")
        yield FigureText(histogram(MetricsView()), classes="histogram")
        yield FigureText(positions(MetricsView()), classes="positions")
        yield FigureText(step_time(MetricsView()), classes="step-time")

    def on_mount(self) -> None:
        self.border_title = "Speculation"

    def watch_view(self, view: MetricsView) -> None:
        """Show the new figures."""
        self.query_one(".headline", FigureText).show(headline(view))
        self.query_one(".acceptance-history", Sparkline).data = list(view.acceptance_history)
        self.query_one(".histogram", FigureText).show(histogram(view))
        self.query_one(".positions", FigureText).show(positions(view))
        self.query_one(".step-time", FigureText).show(step_time(view))

    def watch_drafter(self, drafter: str) -> None:
        """Name the drafter whose steps the figures count (they start afresh at a switch: engine.telemetry)."""
        self.query_one(".drafter", Static).update(drafter_line(drafter))
