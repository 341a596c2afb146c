"""`specchat agent SCRIPT` in the TUI: the model loads (its progress in a notice above the tabs), then each task of
the script runs in a tab of its own with its live trace, beside the Speculation, Throughput, Memory and Controls panels."""

from __future__ import annotations

from specchat.agent.script import AgentScript
from specchat.config import EngineConfig
from specchat.ui.app import SpecchatApp, run_app


class AgentApp(SpecchatApp):
    """The chat app that starts one agent script as soon as its engine is attached."""

    TITLE = "specchat agent"

    def __init__(self, script: AgentScript, config: EngineConfig, concurrency: int | None = None, **kwargs) -> None:
        super().__init__(config=config, sampling=script.sampling, spec=script.speculation, **kwargs)
        self.script = script
        self.concurrency = concurrency
        self.script_started = False

    def attach_engine(self, engine) -> None:
        """Attach as the chat app does, then start the script: on the first engine only (a model switched to later,
        or the previous one back after a switch that failed, must not run its tasks again)."""
        super().attach_engine(engine)
        if not self.script_started:
            self.script_started = True
            self.call_later(self.start_agent, self.script, self.concurrency)


def run_agent_app(script: AgentScript, config: EngineConfig, concurrency: int | None) -> None:
    """Run the app; a load error ends it and is raised here, for the CLI to print as one line. An app that ended in
    an exception (our bug: Textual has printed its traceback) ends the command with its status, 1, not 0."""
    run_app(AgentApp(script, config, concurrency))
