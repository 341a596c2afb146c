"""Agent scripts: a full script parses into validated settings; every bad one is one clear ConfigError line."""

import os
import textwrap
from pathlib import Path

import pytest

from specchat.agent.demos import Demo, DemoCall
from specchat.agent.script import AgentScript, StopCondition, default_system_prompt, load_script
from specchat.errors import ConfigError

FULL = """
model = "./weights/tiny.gguf"
system_prompt = "Be terse."
tasks = ["What is 2 + 2?", "What is 3 * 3?"]
max_steps = 5
max_wall_s = 60
concurrency = 2
workspace = "ws"
copy_workspace = true

[sampling]
temperature = 0.7
top_p = 0.9
top_k = 40
seed = 1
max_tokens = 64

[speculation]
drafter = "draft-model:smollm2-135m"
k = "auto"
k_max = 6

[tools]
enabled = ["python", "read_file", "shell"]
timeout_s = 3
output_cap = 1000

[tools.python]
timeout_s = 7

[tools.shell]
allow = ["ls", "grep"]
confirm = false

[tools.user]
module = "tools/extra.py"
functions = ["double"]

[stop]
regex = "ANSWER: (\\\\d+)"
"""

EXTRA_TOOLS = '''
def double(n: int) -> int:
    """Double a number."""
    return 2 * n
'''


def write(tmp_path: Path, text: str, name: str = "agent.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "tiny.gguf").write_bytes(b"GGUF")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "extra.py").write_text(EXTRA_TOOLS)
    return tmp_path


def test_full_script(project: Path):
    script = load_script(write(project, FULL))
    assert script.name == "agent"
    assert script.model == str(project.resolve() / "weights" / "tiny.gguf")
    assert script.system_prompt == "Be terse."
    assert script.tasks == ["What is 2 + 2?", "What is 3 * 3?"]
    assert (script.max_steps, script.max_wall_s, script.concurrency) == (5, 60.0, 2)
    assert script.workspace == (project / "ws").resolve() and script.copy_workspace
    sampling = script.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed, sampling.max_tokens) == (
        0.7,
        0.9,
        40,
        1,
        64,
    )
    assert (script.speculation.drafter, script.speculation.k, script.speculation.k_max) == (
        "draft-model:smollm2-135m",
        None,
        6,
    )
    tools = script.tools
    assert list(tools.builtin) == ["python", "read_file", "shell"]  # regex stop: no final_answer added
    assert tools.builtin["python"].timeout_s == 7 and tools.builtin["python"].output_cap == 1000
    assert tools.builtin["read_file"].timeout_s == 3
    assert tools.builtin["shell"].allow == ("ls", "grep") and tools.builtin["shell"].confirm is False
    assert [t.name for t in tools.user] == ["double"] and tools.user[0].options.timeout_s == 3
    assert script.stop.answer_in("so ANSWER: 42.") == "42"


def test_minimal_script_gets_defaults(tmp_path: Path):
    script = load_script(write(tmp_path, '\ufefftasks = ["Say hi."]'))  # a BOM, as Windows editors write: ignored
    assert script.model == "smollm2-135m"
    assert script.tools.names == ["final_answer"]
    assert script.stop == StopCondition()
    assert script.system_prompt == default_system_prompt(script.stop) and "final_answer" in script.system_prompt
    assert script.speculation.drafter == "none" and script.workspace is None
    assert isinstance(script, AgentScript)


def test_hub_ids_and_aliases_pass_through(tmp_path: Path):
    script = load_script(write(tmp_path, 'model = "Qwen/Qwen2.5-1.5B-Instruct"\ntasks = ["x"]'))
    assert script.model == "Qwen/Qwen2.5-1.5B-Instruct"


def test_tasks_from_a_text_file(tmp_path: Path):
    (tmp_path / "tasks.txt").write_text("# comment\nfirst task\n\n  second task  \n")
    script = load_script(write(tmp_path, 'tasks_file = "tasks.txt"'))
    assert script.tasks == ["first task", "second task"]


def test_tasks_from_a_toml_file(tmp_path: Path):
    (tmp_path / "tasks.toml").write_text('tasks = ["one", """two\nlines"""]')
    script = load_script(write(tmp_path, 'tasks_file = "tasks.toml"'))
    assert script.tasks == ["one", "two\nlines"]


def test_tag_stop(tmp_path: Path):
    script = load_script(write(tmp_path, 'tasks = ["x"]\n[stop]\ntag = "final"'))
    assert script.tools.names == []
    assert "<final>" in script.system_prompt
    assert script.stop.answer_in("thinking... <final> 391 </final>") == "391"
    assert script.stop.answer_in("<final>cut off") is None


def test_examples_tool_choice_and_a_heads_file(tmp_path: Path):
    path = write(
        tmp_path,
        'tasks = ["x"]\ntool_choice = "first"\n[tools]\nenabled = ["python"]\n'
        '[[examples]]\ntask = "What is 3 * 4?"\nanswer = "12"\n'
        'calls = [{ name = "python", arguments = { code = "print(3 * 4)" }, result = "12" }]\n'
        '[speculation]\ndrafter = "heads:heads.safetensors"',
    )
    script = load_script(path)
    assert script.tool_choice == "first"
    assert script.examples == [Demo("What is 3 * 4?", "12", [DemoCall("python", {"code": "print(3 * 4)"}, "12")])]
    assert script.speculation.drafter == f"heads:{tmp_path / 'heads.safetensors'}"


def test_regex_stop_without_groups_returns_the_match():
    assert StopCondition("regex", r"\d+ apples").answer_in("I count 12 apples.") == "12 apples"
    assert StopCondition().answer_in("<final>x</final>") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('tasks = ["x"]\nmax_step = 3', "unknown key 'max_step'; did you mean 'max_steps'?"),
        ('tasks = ["x"]\n[sampling]\ntemprature = 0.5', "unknown key 'sampling.temprature'; did you mean"),
        ('tasks = ["x"]\nmax_steps = "8"', "max_steps must be an integer, got a string '8'"),
        ('tasks = ["x"]\nmax_steps = 2.5', "max_steps must be an integer, got a number 2.5"),
        ('tasks = ["x"]\nmax_steps = 0', "max_steps must be >= 1, got 0"),
        ('tasks = ["x"]\nconcurrency = true', "concurrency must be an integer, got a boolean True"),
        ('tasks = ["x"]\nmax_wall_s = -1', "max_wall_s must be > 0"),
        ('tasks = ["x"]\nmax_wall_s = inf', "at most"),
        ("tasks = []", "no tasks"),
        ("model = 'smollm2-135m'", "no tasks"),
        ('tasks = ["x"]\nmodel = "bogus"', "model: unknown model 'bogus'"),
        ('tasks = ["x", " "]', "task 2 is empty"),
        ("tasks = [1]", "tasks[0] must be a string, got an integer 1"),
        ('tasks = ["x"]\ntasks_file = "t.txt"', "give tasks or tasks_file, not both"),
        ('tasks_file = "missing.txt"', "tasks_file: no such file"),
        ('tasks_file = "."', "is a directory, not a file"),
        # a FIFO or a device said "no such file" of a path that is there (and reading one waits for its writer)
        ('tasks_file = "fifo"', "tasks_file: {tmp}/fifo is a FIFO (named pipe), not a regular file"),
        ('tasks_file = "/dev/null"', "tasks_file: /dev/null is a character device, not a regular file"),
        ('tasks = ["x"]\nworkspace = "nowhere"', "workspace: no such directory"),
        # a file said "no such directory", a folder the user could see was there
        ('tasks = ["x"]\nworkspace = "agent.toml"', "workspace: {tmp}/agent.toml is a file, not a directory"),
        ('tasks = ["x"]\nmodel = "./missing.gguf"', "model: no such file or directory"),
        (
            'tasks = ["x"]\n[tools]\nenabled = ["pyhton"]',
            "tools.enabled: unknown tool 'pyhton'; did you mean 'python'?",
        ),
        ('tasks = ["x"]\n[tools]\nenabled = ["browser"]', "unknown tool 'browser' (built-in tools: python"),
        ('tasks = ["x"]\n[tools.shell]\nallow = ["ls"]', "tools.shell has options but 'shell' is not in tools.enabled"),
        ('tasks = ["x"]\n[tools]\nenabled = ["shell"]', "shell tool needs an allow list"),
        ('tasks = ["x"]\n[tools]\nenabled = ["shell"]\n[tools.shell]\nallow = ["/bin/rm"]', "bare command names"),
        (
            'tasks = ["x"]\n[tools]\nenabled = ["python"]\n[tools.python]\nallow = ["ls"]',
            "unknown key 'tools.python.allow'",
        ),
        ('tasks = ["x"]\n[tools]\ntimeout_s = 0', "tools: timeout_s must be in (0, 600]"),
        ('tasks = ["x"]\n[tools]\noutput_cap = 10', "output_cap must be >= 200"),
        ('tasks = ["x"]\n[tools.user]\nfunctions = ["f"]', "tools.user.module is required"),
        ('tasks = ["x"]\n[tools.user]\nmodule = "nope.py"', "tools.user: no such file"),
        ('tasks = ["x"]\n[tools.user]\nmodule = "."', "tools.user: {tmp} is a directory, not a file"),
        ('tasks = ["x"]\n[stop]\nregex = "(unclosed"', "stop.regex is not a valid regular expression"),
        ('tasks = ["x"]\n[stop]\ntag = "<final>"', "stop.tag must be a tag name"),
        ('tasks = ["x"]\n[stop]\ntool = "answer"', "stop.tool must be 'final_answer'"),
        ('tasks = ["x"]\n[stop]\ntag = "a"\nregex = "b"', "stop takes one of tool, tag, regex, got tag and regex"),
        ('tasks = ["x"]\n[sampling]\ntop_p = 1.5', "sampling.top_p must be in (0, 1], got 1.5"),
        ('tasks = ["x"]\n[sampling]\nmax_tokens = 0', "sampling.max_tokens must be > 0, got 0"),
        (
            'tasks = ["x"]\n[speculation]\ndrafter = "medusa"',
            "speculation.drafter: unknown drafter 'medusa' (available: none | ngram | heads[:FILE] |",
        ),
        ('tasks = ["x"]\n[speculation]\ndrafter = "ngram:3"', "speculation.drafter: unknown drafter 'ngram:3'"),
        ('tasks = ["x"]\n[speculation]\nk = "many"', 'speculation.k must be an integer or "auto"'),
        (  # the bound is k_max's: the line says which, and where it comes from
            'tasks = ["x"]\n[speculation]\nk = 20',
            "speculation.k must be in [0, 8] or 'auto', got 20 (the bound is speculation.k_max, 8 by default; "
            "the script may set it up to 16)",
        ),
        (
            'tasks = ["x"]\n[speculation]\nk = 5\nk_max = 4',
            "speculation.k must be in [0, 4] or 'auto', got 5 (the bound is speculation.k_max = 4 in the script)",
        ),
        # k was checked first, against the bad bound: "k must be in [0, -1] or 'auto', got 4"
        ('tasks = ["x"]\n[speculation]\nk_max = -1', "speculation.k_max must be in [0, 16], got -1"),
        ('tasks = ["x"]\n[speculation]\nk_max = 17', "speculation.k_max must be in [0, 16], got 17"),
        ('tasks = ["x"]\nsampling = 3', "sampling must be a table, got an integer 3"),
        ('tasks = ["x"]\ntool_choice = "always"', "tool_choice must be one of auto, first, required"),
        ('tasks = ["x"]\ntool_choice = "first"\n[stop]\ntag = "f"', "tool_choice = 'first' needs at least one tool"),
        (
            'tasks = ["x"]\ntool_choice = "required"\n[stop]\ntag = "f"\n[tools]\nenabled = ["python"]',
            "it needs the final_answer stop",
        ),
        ('tasks = ["x"]\nexamples = ["y"]', "examples[1] must be a table ([[examples]]), got a string 'y'"),
        ('tasks = ["x"]\n[[examples]]\ntask = "y"', "examples[1] needs a task and an answer"),
        ('tasks = ["x"]\n[[examples]]\ntask = "y"\nanswr = "z"', "unknown key 'examples[1].answr'"),
        (
            'tasks = ["x"]\n[[examples]]\ntask = "y"\nanswer = "z"\ncalls = [{ name = "grep" }]',
            "examples[1] calls 'grep', which is not an enabled tool",
        ),
        ('tasks = ["x"]\n[[examples]]\ntask = "y"\nanswer = "z"\ncalls = [{ result = "1" }]', "calls[1] needs a name"),
        (  # the example taught a call that every run then made and got an error for
            'tasks = ["x"]\n[tools]\nenabled = ["python"]\n[[examples]]\ntask = "y"\nanswer = "z"\n'
            'calls = [{ name = "python", arguments = { cod = "print(1)" } }]',
            "examples[1].calls[1]: unknown argument 'cod' for python; parameters: code",
        ),
        (
            'tasks = ["x"]\n[tools]\nenabled = ["read_file"]\n[[examples]]\ntask = "y"\nanswer = "z"\n'
            'calls = [{ name = "read_file", result = "1" }]',
            "examples[1].calls[1]: missing required argument 'path' for read_file",
        ),
        (
            'tasks = ["x"]\n[tools]\nenabled = ["read_file"]\n[[examples]]\ntask = "y"\nanswer = "z"\n'
            'calls = [{ name = "read_file", arguments = { path = ["a.txt"] } }]',
            "examples[1].calls[1]: argument 'path' of read_file must be string, got array",
        ),
        (  # a TOML date passed the checks and failed once the model was loaded (not JSON serializable)
            'tasks = ["x"]\n[[examples]]\ntask = "y"\nanswer = "z"\n'
            'calls = [{ name = "python", arguments = { code = 1979-05-27T07:32:00Z } }]',
            "examples[1].calls[1].arguments must be JSON values",
        ),
        (  # the example teaches the reply that should end a run: one the stop misses never ends it
            'tasks = ["x"]\n[stop]\nregex = "ANSWER: (\\\\d+)"\n[[examples]]\ntask = "y"\nanswer = "twelve"',
            "examples[1].answer does not match stop.regex 'ANSWER: (\\\\d+)'",
        ),
        # an empty answer taught the one answer a run turns back (final_answer refuses it, an empty tag is nudged)
        ('tasks = ["x"]\n[[examples]]\ntask = "y"\nanswer = " "', "examples[1].answer is empty: final_answer refuses"),
        (
            'tasks = ["x"]\n[stop]\ntag = "final"\n[[examples]]\ntask = "y"\nanswer = ""',
            "examples[1].answer is empty: <final></final> ends no run",
        ),
        (
            'tasks = ["x"]\n[stop]\nregex = "ANSWER:(.*)"\n[[examples]]\ntask = "y"\nanswer = "ANSWER: "',
            "examples[1].answer leaves stop.regex 'ANSWER:(.*)' an empty answer, which ends no run",
        ),
        ('tasks = ["x"]\n[stop]\nregex = ""', "stop.regex must not match empty text"),  # every reply answered
        ('tasks = ["x"]\n[stop]\nregex = "(A: )?"', "stop.regex must not match empty text"),
        ('tasks = "x"\n[[', "invalid TOML"),
    ],
)
def test_bad_scripts_name_the_file_and_the_key(tmp_path: Path, text: str, message: str):
    os.mkfifo(tmp_path / "fifo")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_script(path)
    line = str(caught.value)
    assert line.startswith(f"{path}: ")
    assert message.replace("{tmp}", str(tmp_path.resolve())) in line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("line", "key"), [("max_tokens = 0", "max_tokens"), ("top_p = 0", "top_p"), ("top_k = -1", "top_k")]
)
def test_sampling_errors_spell_the_key_as_the_script_does(tmp_path: Path, line: str, key: str):
    """The script says max_tokens, where the CLI flag is --max-tokens (its message, `max-tokens must be > 0`, is
    held in tests/cli/test_fuzz.py): a script's message named a key that its user never wrote."""
    with pytest.raises(ConfigError) as caught:
        load_script(write(tmp_path, f'tasks = ["x"]\n[sampling]\n{line}'))
    assert f"sampling.{key} must be" in str(caught.value)
    assert key.replace("_", "-") not in str(caught.value)


def test_missing_script(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"nope\.toml: no such file"):
        load_script(tmp_path / "nope.toml")


def test_user_tool_module_errors_name_the_key(tmp_path: Path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('import-time failure')\n")
    path = write(tmp_path, 'tasks = ["x"]\n[tools.user]\nmodule = "broken.py"')
    with pytest.raises(
        ConfigError, match=r"tools\.user: importing .*broken\.py failed: RuntimeError: import-time failure"
    ):
        load_script(path)


def test_an_example_answer_that_matches_the_regex_stop_loads(tmp_path: Path):
    text = 'tasks = ["x"]\n[stop]\nregex = "ANSWER: (\\\\d+)"\n[[examples]]\ntask = "y"\nanswer = "ANSWER: 12"\n'
    assert load_script(write(tmp_path, text)).examples[0].answer == "ANSWER: 12"


def test_a_tasks_file_with_a_byte_order_mark(tmp_path: Path):
    """A tasks file saved by a Windows editor starts with a BOM: its '# comment' line became a task, and the BOM went
    into the first prompt (the script itself was already read as utf-8-sig)."""
    (tmp_path / "tasks.txt").write_bytes("\ufeff# comment\r\nfirst task\r\n".encode())
    script = load_script(write(tmp_path, 'tasks_file = "tasks.txt"'))
    assert script.tasks == ["first task"]


@pytest.mark.parametrize(("name", "text"), [("tasks.txt", "# only a comment\n\n"), ("tasks.toml", "tasks = []\n")])
def test_a_tasks_file_without_tasks_names_the_file(tmp_path: Path, name: str, text: str):
    """It said 'no tasks: give tasks = [...] or tasks_file = ...', to a script that gave a tasks_file."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=rf": tasks_file {tmp_path.resolve()}/{name} has no tasks"):
        load_script(write(tmp_path, f'tasks_file = "{name}"'))
