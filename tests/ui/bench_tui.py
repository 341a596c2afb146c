"""UI responsiveness under a fast synthetic token stream (FakeEngine), headless.

    python -m tests.ui.bench_tui --rate 200 --tokens-per-step 1 --seconds 10

Measures, while one chat streams `rate` tokens per second through the app's real path (engine listener ->
one EngineStep message per step -> MarkdownStream, metrics, panels on their timer):
- step delay: engine-thread post -> message handled on the UI loop (P50 / P99 / max, ms);
- event-loop lag: how late a 10 ms asyncio sleep wakes up (P50 / P99 / max, ms);
- keystroke latency: a key sent through the driver -> its character in the prompt input (P50 / max, ms);
- catch-up: last post -> the reply finished on screen (ms);
- the tok/s the Throughput panel computed, next to the rate asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from textual import events

from specchat.engine.stats import percentile
from specchat.ui.app import SpecchatApp
from specchat.ui.store import ChatStore
from tests.ui.fake_engine import FakeEngine


async def probe_loop_lag(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep 10 ms at a time and record how late each wake-up is."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.010)
        lags.append((time.perf_counter() - t0 - 0.010) * 1e3)


async def probe_keys(app: SpecchatApp, latencies: list[float], stop: asyncio.Event) -> None:
    """Every 200 ms send one key through the driver (as a terminal would) and time its echo in the input."""
    prompt = app.chat.prompt_input
    while not stop.is_set():
        before = len(prompt.text)
        t0 = time.perf_counter()
        key = events.Key("x", "x")
        key.set_sender(app)
        app._driver.send_message(key)
        while len(prompt.text) == before and time.perf_counter() - t0 < 5:
            await asyncio.sleep(0.001)
        latencies.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0.2)


async def run(rate: float, tokens_per_step: int, seconds: float) -> dict:
    engine = FakeEngine(
        steps_per_s=rate / tokens_per_step, tokens_per_step=tokens_per_step, total_tokens=int(rate * seconds)
    )
    with tempfile.TemporaryDirectory() as tmp:
        app = SpecchatApp(engine=engine, store=ChatStore(Path(tmp) / "chats.sqlite3"), transcript_dir=Path(tmp))
        async with app.run_test(size=(150, 50)) as pilot:
            app.chat.prompt_input.load_text("stream, please")
            await pilot.press("enter")
            pane = app.chat
            lags: list[float] = []
            keys: list[float] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(probe_loop_lag(lags, stop)), asyncio.create_task(probe_keys(app, keys, stop))]
            t0 = time.perf_counter()
            while pane.busy and time.perf_counter() - t0 < seconds * 10 + 30:
                await asyncio.sleep(0.005)
            done = time.perf_counter()
            stop.set()
            await asyncio.gather(*tasks)
            delays = list(app.step_delays_ms)
            shown_rate = app.metrics.view().tok_per_s
            reply = pane.messages[-1]["content"]
    return {
        "rate_asked_tok_s": rate,
        "tokens_per_step": tokens_per_step,
        "steps": len(delays),
        "tokens": app.metrics.total_tokens,
        "reply_chars": len(reply),
        "panel_tok_s": round(shown_rate or 0.0, 1),
        "step_delay_ms": {q: round(percentile(delays, v), 2) for q, v in (("p50", 50), ("p99", 99), ("max", 100))},
        "loop_lag_ms": {q: round(percentile(lags, v), 2) for q, v in (("p50", 50), ("p99", 99), ("max", 100))},
        "keystroke_ms": {q: round(percentile(keys, v), 2) for q, v in (("p50", 50), ("max", 100))},
        "catch_up_ms": round((done - engine.last_post) * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, nargs="+", default=[200.0], help="tokens per second")
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    for rate in args.rate:
        print(json.dumps(asyncio.run(run(rate, args.tokens_per_step, args.seconds))), flush=True)


if __name__ == "__main__":
    main()
