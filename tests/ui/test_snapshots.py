"""Snapshots of the side panels with fixed figures (update with `pytest --snapshot-update`)."""

from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.containers import Horizontal, VerticalScroll

import specchat.ui
from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from specchat.ui.metrics import MetricsView
from specchat.ui.speculation import SpeculationPanel
from specchat.ui.throughput import ThroughputPanel

VIEW = MetricsView(
    steps=412,
    acceptance_now=0.62,
    acceptance_history=(0.2, 0.35, 0.5, 0.55, 0.61, 0.7, 0.66, 0.58, 0.62),
    tokens_per_step_now=2.48,
    emitted_histogram=(0, 30, 22, 18, 15, 15),
    position_acceptance=(0.81, 0.66, 0.52, 0.4),
    draft_ms=0.4,
    verify_ms=21.7,
    k_last=4,
    k_next=4,
    tok_per_s=113.6,
    tok_per_s_history=(80.0, 95.5, 104.0, 110.2, 113.6),
    itl_p50_ms=7.9,
    itl_p99_ms=31.2,
    active_requests=2,
    queue_depth=None,
    total_tokens=1022,
)
MEMORY = {
    "weights_bytes": 162_000_000,
    "linear_weight_bytes": 36_000_000,
    "linear_weight_bytes_bf16": 134_000_000,
    "weights_format": "mxfp4",
    "weights_method": "gptq",
    "weights_restore_bytes": 98_000_000,
    "kv_format": "mxfp4",
    "kv_bytes_per_token": 5_760,
    "kv_bytes_per_token_bf16": 23_040,
    "kv_capacity_tokens": 186_000,
    "kv_used_tokens": 1_536,
    "kv_capacity_bytes": 1_071_360_000,
    "kv_cached_tokens": 512,
    "max_sessions": 22,
    "max_context": 8192,
    "rss_bytes": 1_100_000_000,
    "gpu_bytes": None,
}


class PanelsApp(App):
    """The four side panels, fed fixed figures."""

    CSS_PATH = Path(specchat.ui.__file__).parent / "specchat.tcss"
    AUTO_FOCUS = None
    FILLED = True  # False: before any figure (Textual runs every class's on_mount, so a subclass cannot skip ours)

    def compose(self):
        with Horizontal():
            with VerticalScroll(classes="panels"):
                yield SpeculationPanel()
                yield ThroughputPanel()
            with VerticalScroll(classes="panels"):
                yield MemoryPanel()
                yield ControlsPanel(4, "ngram", ("none", "ngram", "heads"), 0.0)

    def on_mount(self) -> None:
        if not self.FILLED:
            self.query_one(MemoryPanel).memory = {"kv_format": "bf16"}
            return
        self.query_one(SpeculationPanel).drafter = "ngram"
        self.query_one(SpeculationPanel).view = VIEW
        self.query_one(ThroughputPanel).view = VIEW
        self.query_one(MemoryPanel).memory = MEMORY


def test_panels_snapshot(snap_compare):
    assert snap_compare(PanelsApp(), terminal_size=(84, 44))


def test_empty_panels_say_na(snap_compare):
    class EmptyPanels(PanelsApp):
        FILLED = False

    assert snap_compare(EmptyPanels(), terminal_size=(84, 44))
