"""`specchat agent`: JSONL and the readable trace from a real (tiny, random) model; one-line errors."""

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specchat.agent.script import load_script
from specchat.cli import main
from specchat.config import EngineConfig
from tests.agent.scripted_engine import ScriptedEngine


def write_script(tmp_path: Path, model: Path, tools: str = "[]") -> Path:
    """Two tasks for the tiny model (its context is 256 tokens: no tools listed by default, a tag stop)."""
    path = tmp_path / "agent.toml"
    path.write_text(
        f'model = "{model}"\ntasks = ["What is 2 + 2?", "What is 3 + 3?"]\nmax_steps = 2\nconcurrency = 2\n'
        f'[tools]\nenabled = {tools}\n[stop]\ntag = "final"\n[sampling]\nmax_tokens = 8\n'
    )
    return path


def test_json_writes_one_typed_event_per_line(tiny_model_dir, tmp_path):
    script = write_script(tmp_path, tiny_model_dir)
    result = CliRunner().invoke(main, ["agent", str(script), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(isinstance(record["type"], str) for record in records)
    ends = [record for record in records if record["type"] == "run_end"]
    assert sorted(end["run"] for end in ends) == [0, 1]
    assert all(end["reason"] == "max_steps" and "tokens_per_step" in end["stats"] for end in ends)
    assert records[-1]["type"] == "session_end" and records[-1]["runs"] == 2
    # merged stats keep no recent steps: their recent_* rates read 0.0 beside the totals, so they are left out
    merged = [r["stats"] for r in records if r["type"] in ("step", "run_end", "session_end")]
    assert all("tokens_per_step" in stats and not any(key.startswith("recent_") for key in stats) for stats in merged)


def test_headless_prints_a_trace_and_overrides_apply(tiny_model_dir, tmp_path):
    script = write_script(tmp_path, tiny_model_dir)
    args = ["agent", str(script), "--headless", "--device", "cpu", "--concurrency", "1", "--drafter", "heads"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "drafter 'heads' is not available here" in result.stderr  # the tiny model has no trained heads
    assert "[run 0] task: What is 2 + 2?" in result.stdout and "drafter none\n" in result.stdout
    assert "[run 1] end: max_steps after 2 steps" in result.stdout
    assert "[all] 2 runs (2 max_steps)" in result.stdout


def test_a_misspelt_drafter_is_one_line_and_a_nonzero_exit(tiny_model_dir, tmp_path):
    script = write_script(tmp_path, tiny_model_dir)
    result = CliRunner().invoke(main, ["agent", str(script), "--headless", "--device", "cpu", "--drafter", "nosuch"])
    assert result.exit_code != 0
    assert "unknown drafter 'nosuch' (available: none | ngram |" in result.stderr and "Traceback" not in result.output


def test_k_alone_keeps_the_scripts_drafter_and_is_not_blamed_for_it(tiny_model_dir, tmp_path):
    """--k with a script whose heads file is missing: the script's drafter is handled as without --k (a warning, no
    speculation), not `--drafter heads:...: no such file`, a flag not given; the script's k_max stays."""
    script = write_script(tmp_path, tiny_model_dir)
    script.write_text(script.read_text() + '[speculation]\ndrafter = "heads:missing.safetensors"\nk_max = 12\n')
    args = ["agent", str(script), "--headless", "--device", "cpu", "--concurrency", "1", "--k", "10"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "--drafter" not in result.stderr
    assert f"drafter 'heads:{tmp_path / 'missing.safetensors'}' is not available here" in result.stderr


@pytest.mark.parametrize(
    ("k_max", "k", "why"),
    [
        (
            "",
            "20",
            "[0, 8] or 'auto', got 20 (the bound is speculation.k_max, 8 by default; agent.toml may set it up to 16)",
        ),
        ("k_max = 4\n", "6", "[0, 4] or 'auto', got 6 (the bound is speculation.k_max = 4 in agent.toml)"),
    ],
)
def test_k_out_of_range_names_the_flag_and_its_bound(tiny_model_dir, tmp_path, monkeypatch, k_max, k, why):
    """`--k 20` said `k must be in [0, 8] ...`, naming no flag, and with the script's k_max a bound the user never
    gave on the command line."""
    script = write_script(tmp_path, tiny_model_dir)
    script.write_text(script.read_text() + f"[speculation]\n{k_max}")
    monkeypatch.setattr("specchat.engine.engine.Engine.load", lambda *a, **kw: pytest.fail("loaded the model"))
    result = CliRunner().invoke(main, ["agent", str(script), "--headless", "--device", "cpu", "--k", k])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.stderr.splitlines() == [f"specchat: error: --k must be in {why}"]


def test_a_shell_that_asks_is_one_line_naming_the_script_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """Headless, nobody can answer the shell's questions: the line named neither the script nor the key."""
    script = write_script(tmp_path, tiny_model_dir, tools='["shell"]')
    script.write_text(script.read_text() + '[tools.shell]\nallow = ["ls"]\n')
    monkeypatch.setattr("specchat.engine.engine.Engine.load", lambda *a, **k: pytest.fail("loaded the model"))
    result = CliRunner().invoke(main, ["agent", str(script), "--headless", "--device", "cpu"])
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"specchat: error: {script}: tools.shell.confirm: ") and "confirm = false" in line


def test_a_conversation_that_outgrows_the_context_ends_its_run_with_an_error(tiny_model_dir, tmp_path):
    script = write_script(tmp_path, tiny_model_dir, tools='["python", "read_file", "write_file", "list_dir"]')
    result = CliRunner().invoke(main, ["agent", str(script), "--json", "--device", "cpu"])
    records = [json.loads(line) for line in result.stdout.splitlines()]  # the whole trace first,
    errors = [record for record in records if record["type"] == "error"]
    assert errors and all(e["fatal"] and "the model's context holds 256" in e["message"] for e in errors)
    assert records[-1]["reasons"] == {"error": 2}
    assert result.exit_code == 1  # then a nonzero exit: a job in CI or cron does not pass on broken runs
    assert result.stderr.strip().splitlines() == [
        "specchat: error: 2 of 2 runs ended in an error (see the trace above)"
    ]


def test_without_headless_falls_back_to_the_trace_when_the_tui_has_no_agent_view(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("specchat.cli.agent.tui_launcher", lambda: None)
    monkeypatch.setattr("specchat.cli.agent.on_terminal", lambda: True)
    result = CliRunner().invoke(main, ["agent", str(write_script(tmp_path, tiny_model_dir)), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "the TUI has no agent view yet; printing the trace instead" in result.stderr
    assert "[all] 2 runs" in result.stdout


def test_the_tui_agent_view_gets_the_script_when_it_exists(tiny_model_dir, tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr("specchat.cli.agent.tui_launcher", lambda: lambda *args: launched.append(args))
    monkeypatch.setattr("specchat.cli.agent.on_terminal", lambda: True)
    result = CliRunner().invoke(main, ["agent", str(write_script(tmp_path, tiny_model_dir)), "--concurrency", "3"])
    assert result.exit_code == 0, result.output
    script, config, concurrency = launched[0]
    assert script.tasks[0] == "What is 2 + 2?" and config.model == str(tiny_model_dir) and concurrency == 3


def test_without_a_terminal_it_prints_the_trace_instead_of_opening_the_tui(tiny_model_dir, tmp_path, monkeypatch):
    launched = []  # the TUI would wait for Ctrl+Q after the runs: a cron job or a pipe never ended
    monkeypatch.setattr("specchat.cli.agent.tui_launcher", lambda: lambda *args: launched.append(args))
    result = CliRunner().invoke(main, ["agent", str(write_script(tmp_path, tiny_model_dir)), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert not launched and "not a terminal: printing the trace" in result.stderr
    assert "[all] 2 runs" in result.stdout


def test_a_bad_script_is_one_line_and_exit_1(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["x"]\nmax_step = 3\n')
    result = CliRunner().invoke(main, ["agent", str(path), "--headless"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"specchat: error: {path}: unknown key 'max_step'; did you mean 'max_steps'?"
    ]


def test_runs_say_their_weights_and_kv_and_the_script_chooses_them(tiny_model_dir, tmp_path):
    """The script's `kv` reaches the engine and every run's header names weights and KV (issue 15); --kv wins."""
    script = write_script(tmp_path, tiny_model_dir)
    script.write_text('kv = "fp16"\n' + script.read_text())
    cpu = ["--device", "cpu", "--dtype", "float32"]  # (auto loads this dense model in bf16 on a CPU with native bf16)
    result = CliRunner().invoke(main, ["agent", str(script), "--headless", *cpu])
    assert result.exit_code == 0, result.output
    assert "[run 0]   model " in result.stdout and "weights float32, KV fp16, drafter none\n" in result.stdout
    result = CliRunner().invoke(main, ["agent", str(script), "--json", *cpu, "--kv", "bf16"])
    starts = [r for r in map(json.loads, result.stdout.splitlines()) if r["type"] == "run_start"]
    assert [(r["weights"], r["kv"]) for r in starts] == [("float32", "bf16")] * 2


def test_a_bad_weights_or_kv_in_a_script_is_one_line(tiny_model_dir, tmp_path):
    script = write_script(tmp_path, tiny_model_dir)
    script.write_text('kv = "int3"\n' + script.read_text())
    result = CliRunner().invoke(main, ["agent", str(script), "--headless", "--device", "cpu"])
    assert result.exit_code != 0 and "kv must be one of auto, bf16" in result.output
    assert "Traceback" not in result.output


class StdoutGone:
    """A stdout whose every write fails as a full disk or a pipe whose reader has gone does."""

    encoding = "utf-8"

    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, text: str) -> int:
        raise self.error

    def flush(self) -> None:
        pass


class ScriptedCliEngine(ScriptedEngine):
    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("broken_pipe", [False, True])
def test_a_stdout_that_fails_stops_the_runs(tmp_path, monkeypatch, broken_pipe):
    """`--json > /dev/full` ended in an OSError traceback from a run's thread, and the other runs went on. A full
    disk is one line; a pipe whose reader quit is the BrokenPipeError the CLI ends quietly (141) for every command."""
    from specchat.cli.agent import run_headless
    from specchat.errors import SpecchatError

    script = tmp_path / "agent.toml"
    script.write_text('tasks = ["a", "b", "c"]\n[stop]\ntag = "final"\n')
    engine = ScriptedCliEngine(["<final>1</final>"] * 3)
    monkeypatch.setattr("specchat.engine.engine.Engine.load", lambda *args, **kwargs: engine)
    error = BrokenPipeError(errno.EPIPE, "Broken pipe") if broken_pipe else OSError(errno.ENOSPC, "No space left")
    monkeypatch.setattr(sys, "stdout", StdoutGone(error))
    for as_json in (True, False):
        with pytest.raises(SpecchatError if not broken_pipe else BrokenPipeError) as raised:
            run_headless(load_script(script), EngineConfig(model=str(tmp_path)), None, as_json)
        if not broken_pipe:
            assert str(raised.value) == "cannot write the trace to stdout: No space left; the runs were stopped"
    assert engine.requests == []  # the runs stopped at the first failed write: nothing was generated for nobody


def test_a_closed_stdout_is_one_line_before_anything_loads(tmp_path):
    """`specchat agent x.toml >&-`: sys.stdout is None, and the terminal check raised AttributeError."""
    script = tmp_path / "agent.toml"
    script.write_text('tasks = ["a"]\n')
    command = [sys.executable, "-c", "from specchat.cli import main; main()", "agent", str(script)]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.close(1), timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["specchat: error: stdout is closed: the runs' trace has nowhere to go"]


def test_a_second_ctrl_c_while_the_runs_wind_down_ends_the_process(tmp_path, monkeypatch):
    """The first Ctrl-C raises KeyboardInterrupt (exit 130); a second one during the wind-down raised it again inside
    torch's exit hooks, which printed a traceback. After the first, SIGINT is the default: the process just ends."""
    import signal
    import threading

    from specchat.cli.agent import run_headless
    from tests.agent.scripted_engine import HANG

    script = tmp_path / "agent.toml"
    script.write_text('tasks = ["a"]\n[stop]\ntag = "final"\n')
    engines = iter([ScriptedCliEngine([HANG]), ScriptedCliEngine(["<final>1</final>"])])  # hangs until Ctrl-C; answers
    monkeypatch.setattr("specchat.engine.engine.Engine.load", lambda *args, **kwargs: next(engines))
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    # Python's handler, as at a terminal: a process started in the background by a non-interactive shell (`cmd &`)
    # inherits SIGINT ignored, and the run then hung until its max_wall_s ended it
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run_headless(load_script(script), EngineConfig(model=str(tmp_path)), None, True)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_headless(load_script(script), EngineConfig(model=str(tmp_path)), None, True)  # no Ctrl-C: as it was
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


HANGING_AGENT = """
import sys
from tests.agent.scripted_engine import HANG, ScriptedEngine
from tests.agent.test_cli import ScriptedCliEngine
import specchat.engine.engine
specchat.engine.engine.Engine.load = lambda *args, **kwargs: ScriptedCliEngine([HANG, HANG])
from specchat.cli import main
sys.argv = ["specchat", "agent", sys.argv[1], "--json"]
main()
"""


def test_sigterm_stops_the_runs_with_one_line_and_keeps_their_ends(tmp_path):
    """`timeout 60 specchat agent ...` or a cancelled CI job: SIGTERM ended the process at once, without a word, and
    the trace had no run_end for the runs in flight."""
    import signal

    script = tmp_path / "agent.toml"
    script.write_text('tasks = ["a", "b"]\nconcurrency = 2\n[stop]\ntag = "final"\n')
    process = subprocess.Popen(
        [sys.executable, "-c", HANGING_AGENT, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    try:
        lines = [process.stdout.readline(), process.stdout.readline()]  # both runs have started (and hang)
        assert [json.loads(line)["type"] for line in lines] == ["run_start", "run_start"]
        process.send_signal(signal.SIGTERM)
        rest, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    events = [json.loads(line) for line in rest.splitlines()]
    assert sorted((event["type"], event["run"], event["reason"]) for event in events if event["type"] == "run_end") == [
        ("run_end", 0, "cancelled"),
        ("run_end", 1, "cancelled"),
    ]
    assert process.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines() == ["specchat: terminated (SIGTERM)"]
