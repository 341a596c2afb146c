"""The app on the real default model (a real streamed answer, acceptance with a drafter) and live format toggles."""

from __future__ import annotations

import pytest

from specchat.config import EngineConfig
from specchat.errors import ConfigError
from specchat.ui.chat import MessageView
from specchat.ui.memory import MemoryPanel
from specchat.ui.speculation import SpeculationPanel
from tests.conftest import save_tiny_hf
from tests.ui.conftest import SIZE, send, type_prompt, wait_for


def first_real_drafter(engine) -> str | None:
    """A drafter other than "none" that this engine build can make (ngram first: it needs no files)."""
    for name in ("ngram", "heads"):
        try:
            engine.drafter(name)
            return name
        except ConfigError:
            continue
    return None


def panel_text(app, kind, selector: str | None = None) -> str:
    widget = app.main.query_one(kind)
    return str((widget.query_one(selector) if selector else widget).render())


@pytest.mark.slow
async def test_default_model_streams_a_real_answer(default_engine, make_app):
    app = make_app(default_engine, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "What is the capital of France? Answer in one sentence.")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=120, what="the answer")
        answer = pane.messages[1]["content"]
        assert "Paris" in answer
        assert len(app.step_delays_ms) >= 3  # arrived over several steps, one message each
        assert pane.query(MessageView).last().content == answer


PASSAGE = (
    "The engine drafts a few tokens, the model checks them all in one forward pass, and every draft token it "
    "agrees with is kept for free."
)


@pytest.mark.slow
async def test_panels_show_nonzero_acceptance(default_engine, make_app):
    drafter = first_real_drafter(default_engine)
    if drafter is None:
        pytest.skip("this engine build has only the 'none' drafter: nothing drafts, so acceptance is undefined")
    app = make_app(default_engine, max_tokens=48, drafter=drafter, k=4)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, f"Repeat this sentence exactly: {PASSAGE}")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=120, what="the answer")
        await wait_for(
            pilot,
            lambda: "acceptance   n/a" not in panel_text(app, SpeculationPanel, ".headline"),
            what="the panel to show acceptance",
        )
        view = app.metrics.view()
        assert view.acceptance_now > 0, view
        assert view.tokens_per_step_now > 1, view
        assert any(rate > 0 for rate in view.position_acceptance)
        assert "acceptance   0%" not in panel_text(app, SpeculationPanel, ".headline")


@pytest.fixture
def own_tiny_engine(tmp_path):
    """A tiny engine of this test's own (format toggles must not leak into the shared one), head_dim 64 so
    that MXFP4 blocks of 32 fit."""
    from specchat.engine.engine import Engine

    path = save_tiny_hf(tmp_path / "tiny", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    yield engine
    engine.close()


@pytest.mark.parametrize(("setting", "key", "setter"), [("weights", "f3", "set_weights"), ("kv", "f4", "set_kv")])
async def test_toggle_updates_memory_and_the_chat_goes_on(own_tiny_engine, make_app, setting, key, setter):
    if not hasattr(own_tiny_engine, setter):
        pytest.skip(f"this engine build has no {setter}() yet")
    app = make_app(own_tiny_engine, max_tokens=12, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        await send(pilot, app, "before the switch")
        await wait_for(pilot, lambda: len(pane.messages) == 2, what="the first answer")
        await wait_for(pilot, lambda: app.main.query_one(MemoryPanel).memory, what="memory figures")
        before = dict(app.main.query_one(MemoryPanel).memory)
        await pilot.press(key)
        await wait_for(
            pilot,
            lambda: getattr(app.settings, setting) == "mxfp4" or any(n.severity == "error" for n in app._notifications),
            timeout=120,
            what=f"{setting} -> mxfp4",
        )
        errors = [n.message for n in app._notifications if n.severity == "error"]
        assert not errors, errors
        if setting == "weights":  # a model of its own has no MXFP4 checkpoint yet: the app said it quantizes first
            assert [n.title for n in app._notifications].count("Quantizing to MXFP4") == 1
        field = "linear_weight_bytes" if setting == "weights" else "kv_bytes_per_token"
        memory = lambda: app.main.query_one(MemoryPanel).memory
        await wait_for(pilot, lambda: memory().get(field, 0) < before[field], what=f"{field} to shrink")
        assert "mxfp4" in panel_text(app, MemoryPanel)
        await send(pilot, app, "after the switch")
        await wait_for(pilot, lambda: len(pane.messages) == 4, timeout=120, what="an answer after the switch")
        assert pane.messages[3]["content"]
