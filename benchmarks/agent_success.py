"""How often the default model gets agent tasks right: the 135M example scripts with more tasks, answers checked.

    PYTHONPATH=. python benchmarks/agent_success.py

Greedy, so each task either always passes or always fails on a given engine; the figure is the share of tasks.
An answer passes when it equals the expected one, ignoring case, a trailing period and a trailing ".0".
"""

from __future__ import annotations

from pathlib import Path

from specchat.agent.runner import AgentSession
from specchat.agent.script import load_script
from specchat.config import EngineConfig
from specchat.engine.engine import Engine

TASKS = Path(__file__).parent / "agent_tasks"
EXPECTED = {
    "arithmetic_wide.toml": ["391", "6912", "1024", "12", "9801", "643", "243", "9", "1728", "201", "1000", "504"],
    "find_fact_wide.toml": [
        "Aurora",
        "coffee",
        "Tomas Berg",
        "Lisbon",
        "Ines Duarte",
        "Amal Haddad",
        "calm",
        "Halifax",
        "12",
    ],
}


def normalized(answer: str | None) -> str:
    """An answer without case, a trailing period or a trailing '.0'."""
    text = (answer or "").strip().rstrip(".").lower()
    return text.removesuffix(".0")


def main() -> None:
    engine = Engine.load(EngineConfig(device="cpu", dtype="float32"))
    engine.start()
    try:
        for name, expected in EXPECTED.items():
            script = load_script(TASKS / name)
            outcomes = AgentSession(engine, script).run(lambda event: None)
            passed = 0
            for task, want, outcome in zip(script.tasks, expected, outcomes, strict=True):
                ok = normalized(outcome.answer) == want.lower()
                passed += ok
                print(
                    f"{'PASS' if ok else 'FAIL'} {task!r}: {outcome.reason} after {outcome.steps} steps, "
                    f"answer {outcome.answer!r} (expected {want!r})"
                )
            print(f"{name}: {passed}/{len(outcomes)} right, {sum(o.reason == 'final' for o in outcomes)} answered")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
