"""The engine, and the stand-ins the UI and agent tests use, implement the protocols the UI and agents rely on."""

from __future__ import annotations

from specchat.config import SamplingParams
from specchat.engine.api import AgentEngine, ChatEngine, Request
from tests.agent.scripted_engine import ScriptedEngine
from tests.ui.fake_engine import FakeEngine


def test_the_engine_is_a_chat_engine_and_an_agent_engine(tiny_engine):
    assert isinstance(tiny_engine, ChatEngine) and isinstance(tiny_engine, AgentEngine)
    handle = tiny_engine.submit("hello", SamplingParams(max_tokens=2))
    assert isinstance(handle, Request)
    handle.result()


def test_the_stand_ins_implement_what_they_stand_in_for():
    fake = FakeEngine(total_tokens=4)
    assert isinstance(fake, ChatEngine)
    assert isinstance(fake.submit("hi"), Request)
    fake.close()
    scripted = ScriptedEngine(["answer"])
    assert isinstance(scripted, AgentEngine)
    prompt = scripted.encode_prompt([{"role": "user", "content": "q"}])
    assert isinstance(scripted.submit(prompt, SamplingParams(), None), Request)


def test_the_fake_engines_figures_come_from_the_engines_telemetry():
    fake = FakeEngine(steps_per_s=500, tokens_per_step=2, total_tokens=20)
    fake.submit("hi")
    for thread in fake.threads:
        thread.join()
    snap = fake.snapshot()
    assert snap.tokens_total == 20 and snap.finished_total == 1
    assert snap.spec.tokens_per_step == 2 and snap.tok_per_s is not None
