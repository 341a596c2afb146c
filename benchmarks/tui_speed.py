"""Decode speed inside the TUI: the real app (headless, Textual's run_test) on the real model, its engine loaded
by the app's own loader, three long answers in one chat; beside it the same answers with the reply text kept from
the screen (--quiet), which leaves the engine and the app but not the streaming view.

    python benchmarks/tui_speed.py [--model smollm2-135m] [--tokens 400] [--answers 3] [--quiet] [--ui-share S]

(--quiet keeps the chat history's replies empty too, so from the third answer on the model answers at once: use
--answers 2 there.)

Prints, per answer, the tokens, the wall time until the answer is complete on screen and the time until the
engine's last step, as tok/s, how late the app's event loop ran a 20 ms sleep meanwhile (what a key press waits
before the app handles it), and the interval the chat's StreamPacer came to. --ui-share sets the UI thread's
share of a core the pacer keeps to (`pacing.UI_SHARE`; 1: the reply grows 20 times a second, as before). Compare with benchmarks/engine_thread.py (the engine alone, stepped in the
background as the app steps it). The app's loop is polled with plain asyncio sleeps: Pilot.pause waits for the
screen to settle, which forces extra refreshes the app would not make on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests.ui.conftest (after PYTHONPATH: A/B trees)

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.sequence import Finished
from specchat.ui import bridge, pacing
from specchat.ui.app import SpecchatApp
from specchat.ui.messages import EngineStep
from specchat.ui.store import ChatStore
from tests.ui.conftest import SIZE, send

PROMPT = "Write a long story about a robot who learns to paint."


def keep_text_off_screen() -> None:
    """--quiet: the bridge passes on only the steps that finish a request (the answer then appears at once)."""

    def on_step(self, events: list) -> None:
        finished = [event for event in events if isinstance(event, Finished)]
        if finished:
            self.app.post_message(EngineStep(finished, time.perf_counter()))

    bridge.EngineBridge.on_step = on_step


async def until(condition, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not come")
        await asyncio.sleep(0.05)


async def loop_lag(lags: list[float], period_s: float = 0.02) -> None:
    """Append how late each `period_s` sleep of the app's event loop wakes, in seconds, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(period_s)
        lags.append(loop.time() - asked - period_s)


def lag_line(lags: list[float]) -> str:
    ms = sorted(1e3 * lag for lag in lags) or [0.0]
    p50, p90, p99 = (ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.5, 0.9, 0.99))
    return f"loop lag P50 {p50:.0f} / P90 {p90:.0f} / P99 {p99:.0f} / max {ms[-1]:.0f} ms"


async def run(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp())
    app = SpecchatApp(
        config=EngineConfig(model=args.model, device="cpu"),
        sampling=SamplingParams(max_tokens=args.tokens, temperature=0.0),
        spec=SpecParams(drafter=args.drafter, k=0 if args.drafter == "none" else None),
        store=ChatStore(folder / "chats.sqlite3"),
        transcript_dir=folder,
    )
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.engine is not None and app.bridge is not None)
        last_step, tokens = [0.0], []

        def listen(events: list) -> None:  # (engine thread)
            last_step[0] = time.perf_counter()
            tokens.extend(len(event.token_ids) for event in events if isinstance(event, Finished))

        app.engine.listeners.append(listen)
        lags: list[float] = []
        probe = asyncio.create_task(loop_lag(lags))
        for i in range(args.answers):
            lags.clear()
            started = time.perf_counter()
            await send(pilot, app, PROMPT + " Again." * i)
            await until(lambda pane=app.chat, n=2 * (i + 1): len(pane.messages) == n)
            shown, engine, n = time.perf_counter() - started, last_step[0] - started, tokens[-1]
            print(f"answer {i + 1}: {n} tokens, on screen after {shown:.2f} s ({n / shown:.1f} tok/s), "
                  f"the engine's last step after {engine:.2f} s ({n / engine:.1f} tok/s); {lag_line(lags)}; interval {app.chat.pacer.interval * 1e3:.0f} ms", flush=True)  # fmt: skip
        probe.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--answers", type=int, default=3)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--ui-share", type=float, default=pacing.UI_SHARE, help="the UI's share of a core (1: 20 Hz)")
    parser.add_argument("--quiet", action="store_true", help="keep the reply text off the screen while it streams")
    args = parser.parse_args()
    pacing.UI_SHARE = args.ui_share
    if args.quiet:
        keep_text_off_screen()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
