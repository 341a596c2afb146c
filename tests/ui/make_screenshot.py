"""The README picture: the app on the default model with the n-gram drafter, after one real answer.

python -m tests.ui.make_screenshot docs/img/specchat-tui.svg
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.ui.app import SpecchatApp
from specchat.ui.store import ChatStore

PROMPT = "Write a Python function that reverses a string, then show how to call it."


async def shoot(out: Path) -> None:
    engine = Engine.load(EngineConfig(device="cpu", dtype="float32"))
    with tempfile.TemporaryDirectory() as tmp:
        app = SpecchatApp(
            engine=engine,
            sampling=SamplingParams(max_tokens=160),
            spec=SpecParams(drafter="ngram", k=4),
            store=ChatStore(Path(tmp) / "chats.sqlite3"),
            transcript_dir=Path(tmp),
        )
        async with app.run_test(size=(160, 50)) as pilot:
            app.chat.prompt_input.load_text(PROMPT)
            await pilot.press("enter")
            deadline = time.monotonic() + 300
            while (app.chat.busy or not app.chat.messages) and time.monotonic() < deadline:
                await pilot.pause(0.1)
            app.chat.prompt_input.load_text("Now make it handle None.")
            await pilot.pause(1.5)  # panels and memory refresh
            app.save_screenshot(filename=out.name, path=str(out.parent))
    engine.close()


if __name__ == "__main__":
    asyncio.run(shoot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/specchat-tui.svg")))
