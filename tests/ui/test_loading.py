"""Loading behind a notice (issue 21): what is typed while the model loads lands in the prompt, a message sent then
waits in the chat and is answered once the engine is ready; nothing is lost, no dialog takes the keyboard."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.errors import ModelNotFoundError, SpecchatError
from specchat.ui.app import STOPPED_WAITING, SpecchatApp
from specchat.ui.chat import WAITING, MessageView
from specchat.ui.loading import LoadingNotice
from specchat.ui.screens import ModelScreen
from tests.ui.conftest import SIZE, type_prompt, wait_for
from tests.ui.fake_engine import FakeEngine


class SlowLoader:
    """Loads `engine` only once released (a test's stand-in for a slow fetch and load), reporting progress."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, config: EngineConfig, progress) -> object:
        self.started.set()
        progress("reading weights", 1, 2)
        if not self.release.wait(timeout=120):
            raise ModelNotFoundError("the test never released the loader")
        progress("reading weights", 2, 2)
        return self.engine


def slow_app(loader, store, tmp_path: Path, max_tokens: int = 12) -> SpecchatApp:
    return SpecchatApp(
        config=EngineConfig(model="tiny", device="cpu"),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        spec=SpecParams(drafter="ngram", k=3),
        store=store,
        transcript_dir=tmp_path,
        loader=loader,
    )


def footer(view: MessageView) -> str:
    return str(view.query_one(".footer").render())


async def test_typed_and_sent_during_a_slow_load_is_answered_after_it(tiny_engine, store, tmp_path):
    loader = SlowLoader(tiny_engine)
    app = slow_app(loader, store, tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, loader.started.is_set, what="the loader to start")
            await wait_for(pilot, lambda: app.main.query(LoadingNotice), what="the loading notice")
            pane = app.chat
            assert pane.prompt_input.has_focus  # from the first frame: no dialog holds the keyboard
            assert "Type your message now" in str(pane.query_one(".welcome").render())
            await pilot.press(*"hello")
            assert pane.prompt_input.text == "hello"
            await pilot.press("enter")
            await type_prompt(pilot, "and more")  # a second message joins the waiting one: one turn
            (waiting,) = pane.query(MessageView)
            assert waiting.content == "hello\n\nand more" and WAITING in footer(waiting)
            assert pane.prompt_input.text == "" and app.engine is None and not app.requests
            assert not [n.message for n in app._notifications if n.severity != "information"]

            loader.release.set()
            await wait_for(pilot, lambda: not app.main.query(LoadingNotice), what="the notice to go")
            await wait_for(pilot, lambda: pane.busy or len(pane.messages) == 2, what="the waiting message sent")
            assert WAITING not in footer(waiting)
            await wait_for(pilot, lambda: len(pane.messages) == 2, what="the answer")
            reply = pane.query(MessageView).last()
            assert reply.role == "assistant" and reply.content == pane.messages[1]["content"] != ""
            assert len(app.step_delays_ms) >= 11  # streamed, one message per step (12 tokens: prefill + 11)
            assert "12 tokens" in footer(reply)
    finally:
        loader.release.set()
    stored = store.messages(pane.conversation_id)
    assert [(m.role, m.content) for m in stored] == [("user", "hello\n\nand more"), ("assistant", reply.content)]


async def test_a_waiting_message_the_model_cannot_take_goes_back_to_the_prompt(tiny_engine, store, tmp_path):
    loader = SlowLoader(tiny_engine)
    app = slow_app(loader, store, tmp_path)
    too_long = " ".join(["word"] * 2000)  # the tiny model's context holds 256 tokens
    try:
        async with app.run_test(size=SIZE) as pilot:
            pane = app.chat
            pane.prompt_input.load_text(too_long)
            await pilot.press("enter")
            await wait_for(pilot, lambda: pane.waiting is not None, what="the message to wait")
            loader.release.set()
            await wait_for(pilot, lambda: app.engine is not None and pane.waiting is None, what="the attempt")
            (view,) = pane.query(MessageView)
            assert footer(view).startswith("not sent: ") and pane.messages == []
            assert pane.prompt_input.text == too_long and not pane.busy
            assert any(n.severity == "error" for n in app._notifications)
    finally:
        loader.release.set()
    again = SpecchatApp(engine=tiny_engine, store=store, transcript_dir=tmp_path)
    async with again.run_test(size=SIZE) as pilot:  # reopened, it is shown and still not given to the model
        await again.open_conversation(pane.conversation_id)
        await pilot.pause()
        (view,) = again.chat.query(MessageView)
        assert footer(view).startswith("not sent: ") and again.chat.messages == []


async def test_escape_holds_back_a_message_waiting_for_the_model(tiny_engine, store, tmp_path):
    """Esc on a message typed while the model loads: it is not sent once the model is ready (it was, whatever the
    user pressed), stays in the chat and the store marked "not sent", and is back in the prompt box."""
    loader = SlowLoader(tiny_engine)
    app = slow_app(loader, store, tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            pane = app.chat
            await type_prompt(pilot, "never mind")
            await wait_for(pilot, lambda: pane.waiting is not None, what="the message to wait")
            await pilot.press("escape")
            assert pane.waiting is None and pane.messages == []
            (view,) = pane.query(MessageView)
            assert footer(view) == f"not sent: {STOPPED_WAITING}"
            assert pane.prompt_input.text == "never mind"
            loader.release.set()
            await wait_for(pilot, lambda: app.engine is not None, what="the model")
            await pilot.pause()
            assert not pane.busy and not app.requests and pane.messages == []
    finally:
        loader.release.set()
    (stored,) = store.messages(pane.conversation_id)
    assert stored.content == "never mind" and stored.meta["footer"] == f"not sent: {STOPPED_WAITING}"


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (ModelNotFoundError("unknown model 'nope'"), "unknown model 'nope'"),
        # not ours (a damaged weights file): it ended the app with a worker's traceback; now the CLI's one line
        (OSError(5, "Input/output error"), "tiny did not load: OSError: [Errno 5] Input/output error"),
    ],
)
async def test_a_failed_load_ends_the_app_with_its_error(store, tmp_path, error, said):
    def failing(config, progress):
        raise error

    app = slow_app(failing, store, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.return_value is not None, what="the app to end")
    assert isinstance(app.return_value, SpecchatError) and str(app.return_value) == said


async def test_a_model_switch_keeps_the_chats_and_a_message_sent_meanwhile(tiny_engine, store, tmp_path):
    """The palette's Switch model: the chat stays, a message sent while the new model loads waits for it and is
    answered by it; a switch that fails to load brings the previous model back."""
    loader = SlowLoader(FakeEngine(total_tokens=5))
    app = SpecchatApp(
        engine=tiny_engine,
        config=EngineConfig(model="smollm2-135m", device="cpu"),
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        store=store,
        transcript_dir=tmp_path,
        loader=loader,
    )
    try:
        async with app.run_test(size=SIZE) as pilot:
            pane = app.chat
            await type_prompt(pilot, "first, on the tiny model")
            await wait_for(pilot, lambda: len(pane.messages) == 2 and not pane.busy, what="the first answer")
            app.action_switch_model()
            await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), what="the model list")
            await app.screen.dismiss("smollm2-360m")
            await wait_for(pilot, loader.started.is_set, what="the new model to load")
            assert app.engine is None and app.main.query(LoadingNotice) and pane.prompt_input.has_focus
            assert app.settings.drafter == "none"  # the new model's models.toml names no drafter
            await type_prompt(pilot, "second, on the new model")
            assert WAITING in footer(pane.query(MessageView).last())
            loader.release.set()
            await wait_for(pilot, lambda: len(pane.messages) == 4 and not pane.busy, what="the second answer")
            assert app.engine is loader.engine and pane.messages[3]["content"].startswith("the quick brown")
            assert [m["role"] for m in pane.messages] == ["user", "assistant", "user", "assistant"]
    finally:
        loader.release.set()


@pytest.mark.parametrize(
    ("error", "note"),
    [
        (ModelNotFoundError("model 'broken': no weights"), "no weights; loading tiny again"),
        # not ours (out of memory): it ended the app with a worker's traceback
        (MemoryError("cannot allocate 140 GB"), "broken did not load: MemoryError: cannot allocate 140 GB"),
    ],
)
async def test_a_switch_that_fails_loads_the_previous_model_again(tiny_engine, store, tmp_path, error, note):
    loaded: list[str] = []

    def loader(config: EngineConfig, progress) -> object:
        loaded.append(config.model)
        if config.model == "broken":
            raise error
        return tiny_engine

    app = SpecchatApp(engine=tiny_engine, config=EngineConfig(model="tiny"), store=store, loader=loader)
    async with app.run_test(size=SIZE) as pilot:
        await app.switch_model("broken")
        await wait_for(pilot, lambda: app.engine is not None, what="the previous model back")
        assert loaded == ["broken", "tiny"] and app.is_running
        assert any(note in n.message for n in app._notifications)
