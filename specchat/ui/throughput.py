"""The Throughput panel: tokens per second and inter-token latency percentiles."""

from __future__ import annotations

from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Sparkline

from specchat.ui.figures import NA, FigureText, count, num
from specchat.ui.metrics import MetricsView


def throughput_text(view: MetricsView) -> str:
    queue = NA if view.queue_depth is None else str(view.queue_depth)
    return (
        f"tok/s        [b]{num(view.tok_per_s)}[/b]\n"
        f"ITL p50      {num(view.itl_p50_ms, 1, ' ms')}\n"
        f"ITL p99      {num(view.itl_p99_ms, 1, ' ms')}\n"
        f"requests     {view.active_requests} · queue {queue}\n"
        f"tokens       {count(view.total_tokens)} · steps {count(view.steps)}"
    )


class ThroughputPanel(Vertical):
    """How fast tokens arrive."""

    view: reactive[MetricsView] = reactive(MetricsView, init=False)

    def compose(self):
        yield FigureText(throughput_text(MetricsView()), classes="figures")
        yield Sparkline([], classes="rate-history")

    def on_mount(self) -> None:
        self.border_title = "Throughput"

    def watch_view(self, view: MetricsView) -> None:
        """Show the new figures."""
        self.query_one(".figures", FigureText).show(throughput_text(view))
        self.query_one(".rate-history", Sparkline).data = list(view.tok_per_s_history)
