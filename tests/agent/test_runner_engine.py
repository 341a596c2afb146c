"""The agent loop on the real default model: a whole run with a valid JSONL log, and concurrency that changes
nothing but speed (greedy transcripts of 4 runs in flight equal those of the same runs one at a time)."""

import io
import json
from pathlib import Path

import pytest

from specchat.agent.runner import AgentSession
from specchat.agent.script import load_script
from specchat.agent.trace import JsonlWriter

pytestmark = pytest.mark.slow

EVENT_TYPES = {"run_start", "step", "tool_call", "tool_result", "final", "error", "run_end", "session_end"}
TASKS = ["What is 17 * 23?", "What is 1234 + 5678?", "What is 2 to the power of 10?", "What is 144 divided by 12?"]


def write_script(tmp_path: Path, tasks: list[str], max_tokens: int, drafter: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(
        f"tasks = {json.dumps(tasks)}\nmax_steps = 2\n"
        '[tools]\nenabled = ["python", "final_answer"]\n'
        f"[sampling]\nmax_tokens = {max_tokens}\n"
        f'[speculation]\ndrafter = "{drafter}"\nk = 3\n'
    )
    return path


def test_a_full_loop_writes_a_valid_jsonl_log(default_engine, tmp_path):
    stream = io.StringIO()
    session = AgentSession(default_engine, load_script(write_script(tmp_path, TASKS[:1], 40, "ngram")))
    outcomes = session.run(JsonlWriter(stream).write)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert {record["type"] for record in records} <= EVENT_TYPES
    assert records[0]["type"] == "run_start" and records[-1]["type"] == "session_end"
    end = records[-2]
    assert end["type"] == "run_end" and end["reason"] in ("final", "max_steps")
    steps = [record for record in records if record["type"] == "step"]
    assert len(steps) == end["steps"] == outcomes[0].steps <= 2
    assert all(step["stats"]["tokens_per_step"] >= 1 and step["tokens"] > 0 for step in steps)
    assert end["tokens"] == sum(step["tokens"] for step in steps)
    assert records[-1]["tokens"] == end["tokens"] and records[-1]["reasons"] == {end["reason"]: 1}


def test_concurrent_runs_give_the_sequential_transcripts(default_engine, tmp_path):
    script = load_script(write_script(tmp_path, TASKS, 24, "ngram"))
    sequential = AgentSession(default_engine, script, concurrency=1).run(lambda event: None)
    default_engine.start()  # the step loop in the background, batching the 4 runs' requests
    try:
        concurrent = AgentSession(default_engine, script, concurrency=4).run(lambda event: None)
    finally:
        default_engine.close()
    assert [run.messages for run in concurrent] == [run.messages for run in sequential]
    assert [run.reason for run in concurrent] == [run.reason for run in sequential]
    assert all(len(run.messages) >= 3 for run in concurrent)  # each run got at least one reply


def test_the_find_fact_example_completes_on_the_default_model(default_engine):
    script = load_script(Path(__file__).parents[2] / "examples" / "agents" / "find_fact.toml")
    outcomes = AgentSession(default_engine, script).run(lambda event: None)
    assert [(run.reason, run.answer) for run in outcomes] == [
        ("final", "Aurora"),
        ("final", "coffee"),
        ("final", "Tomas Berg"),
    ]
