"""UI test helpers: an app on a given engine with its own store, and polling instead of sleeping."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual import events
from textual.pilot import Pilot

from specchat.config import SamplingParams, SpecParams
from specchat.ui.app import SpecchatApp
from specchat.ui.store import ChatStore

SIZE = (150, 50)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run `async def` tests in a fresh event loop (Pilot needs one; no asyncio plugin required)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(pyfuncitem.obj(**kwargs))
    return True


async def wait_for(pilot: Pilot, condition: Callable[[], object], timeout: float = 60.0, what: str = "") -> None:
    """Let the app run until `condition()` is true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await pilot.pause(0.05)


async def type_prompt(pilot: Pilot, text: str) -> None:
    """Type into the focused prompt and press Enter."""
    await pilot.press(*[" " if c == " " else c for c in text])
    await pilot.press("enter")


def press_now(app: SpecchatApp, key: str) -> None:
    """Send a key as a terminal would, without waiting for the app to go idle (Pilot.press waits for that,
    which during a stream means until the answer ends)."""
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    app._driver.send_message(event)


async def send(pilot: Pilot, app: SpecchatApp, text: str) -> None:
    """Put a prompt into the active chat's input at once and press Enter (without waiting for idle)."""
    app.chat.prompt_input.load_text(text)
    press_now(app, "enter")
    await wait_for(pilot, lambda: app.chat.prompt_input.text == "", what="the prompt to be taken")


@pytest.fixture
def store(tmp_path: Path) -> ChatStore:
    db = ChatStore(tmp_path / "chats.sqlite3")
    yield db
    db.close()


@pytest.fixture
def make_app(store: ChatStore, tmp_path: Path):
    """SpecchatApp on a loaded engine, saving into this test's folder."""

    def make(engine, max_tokens: int = 16, drafter: str = "none", k: int | None = 4, **sampling) -> SpecchatApp:
        return SpecchatApp(
            engine=engine,
            sampling=SamplingParams(max_tokens=max_tokens, **sampling),
            spec=SpecParams(drafter=drafter, k=k),
            store=store,
            transcript_dir=tmp_path,
        )

    return make


@pytest.fixture(scope="session")
def roomy_engine(tmp_path_factory):
    """The tiny random model with an 8k context, so a stream lasts long enough for a key to land mid-answer."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from tests.conftest import save_tiny_hf

    path = save_tiny_hf(tmp_path_factory.mktemp("roomy-tiny"), {"max_position_embeddings": 8192})
    return Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))


def crash_on_mount(monkeypatch: pytest.MonkeyPatch, app_class: type, home: Path) -> None:
    """Make `app_class` end in an exception as it mounts (a bug of ours), run headless: what the exit-status tests of
    `run` and `agent` start."""
    monkeypatch.setenv("SPECCHAT_HOME", str(home))

    def broken(self) -> None:
        raise RuntimeError("a bug of ours")

    run = app_class.run
    monkeypatch.setattr(app_class, "on_mount", broken)
    monkeypatch.setattr(app_class, "run", lambda self, **kwargs: run(self, headless=True, **kwargs))
