"""Every example agent runs on the default model out of the box (issue 18): each names smollm2-135m, says in its
header what it shows, and (slow) runs headless, offline, to a valid end with at least one tool call per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specchat.agent.script import load_script

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "agents").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_each_example_runs_on_the_default_model_and_says_what_it_shows(path: Path):
    assert load_script(path).model == "smollm2-135m"
    lines = path.read_text().splitlines()
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert len(header) >= 2 and f"specchat agent examples/agents/{path.name} --headless" in header[-1]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_each_example_ends_every_run_with_an_answer_after_a_tool_call(path: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1"}  # offline: the cached default model only
    proc = subprocess.run(
        [sys.executable, "-m", "specchat", "agent", str(path), "--json", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    ends = [e for e in events if e["type"] == "run_end"]
    assert len(ends) == len(load_script(path).tasks) and all(e["reason"] == "final" for e in ends), ends
    called = {e["run"] for e in events if e["type"] == "tool_call"}
    assert called == {e["run"] for e in ends}
