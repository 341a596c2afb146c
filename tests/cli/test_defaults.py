"""$SPECCHAT_HOME/config.toml: `run` takes model, drafter, k, weights, KV, temperature, theme and system prompt
from it, a flag given on the command line wins, and a mistake in the file is one line naming the file and key."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from specchat.cli import main
from specchat.cli.defaults import RunDefaults, load_defaults
from specchat.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_no_file_no_defaults(tmp_path: Path):
    assert load_defaults(tmp_path / "config.toml") == RunDefaults()


def test_a_defaults_file_that_is_a_folder_is_one_line(tmp_path: Path):
    """A folder (or a FIFO) named config.toml was ignored without a word: the user's defaults silently not applied."""
    (tmp_path / "config.toml").mkdir()
    with pytest.raises(ConfigError, match=r"config\.toml is a directory, not a file: the defaults file must be"):
        load_defaults(tmp_path / "config.toml")


def test_every_key(tmp_path: Path, tiny_model_dir: Path):
    path = write(
        tmp_path,
        f'model = "{tiny_model_dir}"\ndrafter = "ngram"\nk = "auto"\nweights = "mxfp4"\nkv = "k8v4"\n'
        'temperature = 1\ntheme = "nord"\nsystem = "Be brief."\n',
    )
    assert load_defaults(path) == RunDefaults(
        str(tiny_model_dir), "ngram", "auto", "mxfp4", "k8v4", 1, "nord", "Be brief."
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("k = ", "invalid TOML"),
        ("max_tokens = 5", "unknown key 'max_tokens' (known: model, drafter, k,"),
        ('k = "many"', "k must be an integer or 'auto', got 'many'"),
        ("k = 99", "k must be in [0, 8]"),
        ("k = true", "k must be an integer or 'auto', got True"),
        ('weights = "fp8"', "weights must be one of auto, bf16, mxfp4, got 'fp8'"),
        ("kv = 4", "kv must be a string, got 4"),
        ("temperature = -1", "temperature must be a finite number >= 0"),
        ('temperature = "hot"', "temperature must be a number, got 'hot'"),
        ('theme = "neon"', "theme must be one of"),
        ('drafter = "nope"', "drafter: unknown drafter 'nope'"),
        ('drafter = "heads:/nonexistent"', "drafter: no such file /nonexistent"),
        ('drafter = "eagle:/nonexistent"', "drafter: no such directory /nonexistent"),
        ('drafter = "draft-model:nonesuch"', "drafter: unknown model 'nonesuch'"),
        ('model = "./missing.gguf"', "model: model file not found: ./missing.gguf"),
        ('model = ""', "model is empty: leave the key out for the default model"),
        ('system = ["a"]', "system must be a string"),
    ],
)
def test_a_mistake_names_the_file_and_the_key(tmp_path: Path, text: str, needle: str):
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as error:
        load_defaults(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and needle in message and "\n" not in message, message


def run_plain(home: Path, *args: str):
    """`specchat run --plain` with no input: it says what it loads, then ends at end of input."""
    return CliRunner().invoke(main, ["run", "--plain", *args], input="", env={"SPECCHAT_HOME": str(home)})


def test_run_takes_the_file_and_flags_win(tmp_path: Path, tiny_model_dir: Path):
    write(tmp_path, f'model = "{tiny_model_dir}"\ndrafter = "ngram"\nk = 2\n')
    result = run_plain(tmp_path)
    assert result.exit_code == 0, result.output
    assert f"loading {tiny_model_dir.name} (drafter ngram, k 2)" in result.stderr
    result = run_plain(tmp_path, "--k", "auto", "--drafter", "none")
    assert f"loading {tiny_model_dir.name} (drafter none, k auto)" in result.stderr


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('k = "lots"', "k must be an integer or 'auto', got 'lots'"),
        # it said `--drafter heads:/nonexistent: no such file /nonexistent`, a flag the user never gave
        ('drafter = "heads:/nonexistent"', "drafter: no such file /nonexistent"),
    ],
)
def test_run_with_a_bad_file_is_one_line_naming_it(tmp_path: Path, line: str, why: str):
    write(tmp_path, line + "\n")
    result = run_plain(tmp_path)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"specchat: error: {tmp_path / 'config.toml'}: {why}"]


def test_the_plain_chat_gets_the_files_system_prompt_and_temperature(tmp_path: Path, tiny_model_dir, monkeypatch):
    write(tmp_path, f'model = "{tiny_model_dir}"\nsystem = "Be brief."\ntemperature = 0.5\n')
    seen = {}

    def fake_repl(chat) -> None:
        seen.update(system=chat.system, temperature=chat.sampling.temperature, messages=chat.messages)

    monkeypatch.setattr("specchat.cli.run.plain_repl", fake_repl)
    assert run_plain(tmp_path).exit_code == 0
    assert seen == {"system": "Be brief.", "temperature": 0.5, "messages": [{"role": "system", "content": "Be brief."}]}
    assert run_plain(tmp_path, "--system", "Be long.", "--temperature", "0").exit_code == 0
    assert seen["system"] == "Be long." and seen["temperature"] == 0.0
