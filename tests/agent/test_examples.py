"""The example scripts load, and their workspaces hold what their tasks need (checked with the tools)."""

from pathlib import Path

import pytest

from specchat.agent.isolation import namespaces_available
from specchat.agent.sandbox import run_workspace
from specchat.agent.script import load_script
from specchat.agent.tools import build_toolbox

EXAMPLES = Path(__file__).parents[2] / "examples" / "agents"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda path: path.stem)
def test_example_loads_and_builds_its_toolbox(path: Path):
    script = load_script(path)
    with run_workspace(script.workspace, script.copy_workspace) as workspace:
        schemas = build_toolbox(script.tools, workspace).schemas()
    assert [s["function"]["name"] for s in schemas] == script.tools.names


def test_find_fact_workspace_holds_the_facts():
    script = load_script(EXAMPLES / "find_fact.toml")
    box = build_toolbox(script.tools, script.workspace)
    assert "named Aurora" in box.call("read_file", {"path": "ship.txt"}).content
    assert "carries coffee" in box.call("read_file", {"path": "cargo.txt"}).content
    assert "navigator is Tomas Berg" in box.call("read_file", {"path": "crew.txt"}).content


def test_the_135m_examples_show_the_pattern_they_ask_for():
    for name in ("arithmetic", "find_fact"):
        script = load_script(EXAMPLES / f"{name}.toml")
        assert script.tool_choice == "first" and len(script.examples) == 2
        assert all(script.stop.answer_in(demo.answer) for demo in script.examples)  # the regex reads the demos


@pytest.mark.skipif(not namespaces_available(), reason="the example's python tool needs user namespaces (no opt-in)")
def test_fix_code_fails_before_the_fix_and_passes_after():
    script = load_script(EXAMPLES / "fix_code.toml")
    check = {"code": "exec(open('check.py').read())"}
    with run_workspace(script.workspace, script.copy_workspace) as workspace:
        box = build_toolbox(script.tools, workspace)
        before = box.call("python", check)
        assert not before.ok and "expected 2.5" in before.content
        source = box.call("read_file", {"path": "stats.py"}).content
        fixed = source.replace(
            "    return ordered[middle]",
            "    if len(ordered) % 2:\n        return ordered[middle]\n"
            "    return (ordered[middle - 1] + ordered[middle]) / 2",
        )
        assert box.call("write_file", {"path": "stats.py", "content": fixed}).ok
        assert box.call("python", check).content == "all checks passed\n"
    assert "return ordered[middle]\n" in (EXAMPLES / "fix_code" / "stats.py").read_text()  # the copy took it


def test_unit_convert_user_tools():
    box = build_toolbox(load_script(EXAMPLES / "unit_convert.toml").tools, EXAMPLES)
    assert box.call("convert_length", {"value": 26.2, "from_unit": "mi", "to_unit": "km"}).content == "42.16 km"
    assert box.call("convert_temperature", {"value": 451, "to_unit": "C"}).content == "232.8 C"


def test_log_search_shell_answers():
    script = load_script(EXAMPLES / "log_search.toml")
    box = build_toolbox(script.tools, script.workspace)
    assert box.call("shell", {"command": "grep -c ERROR app.log"}).content == "3\n"
    assert "billing" in box.call("shell", {"command": "grep -m 1 ERROR app.log"}).content
