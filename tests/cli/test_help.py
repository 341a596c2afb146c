"""`specchat --help` shows each command's whole first sentence; `run --help` lists every drafter, unbroken."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from specchat.cli import main
from specchat.config import DRAFTER_SYNTAX


def help_text(*args: str, width: int = 80) -> str:
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.output


def commands_section(text: str) -> str:
    return text[text.index("Commands:") :]


def test_the_command_list_shows_whole_descriptions():
    text = help_text()
    section = " ".join(commands_section(text).split())
    assert "..." not in section
    for name, command in main.commands.items():
        first_sentence = command.get_short_help_str(limit=10**6)
        assert f"{name} {first_sentence}" in section, (name, first_sentence)


def test_a_wide_terminal_gets_one_line_per_command():
    lines = commands_section(help_text(width=200)).splitlines()[1:]
    assert len([line for line in lines if line.strip()]) == len(main.commands)


def test_run_help_lists_every_drafter():
    for width in (80, 120):
        text = help_text("run", width=width)
        assert DRAFTER_SYNTAX in " ".join(text.split()), text  # draft-model never split at its hyphen
        assert "draft-\n" not in text and "ngram+heads[:FILE]" in text


LIGHT_COMMANDS = (["--help"], ["--version"], ["models"], *([name, "--help"] for name in main.commands))


def test_help_and_models_do_not_import_torch():
    """`specchat --help`, `--version`, `models` and every command's help answer without importing torch (about 1.5 s
    of a 2 s start on a 2-core Xeon); a command that runs the engine imports it when it runs."""
    code = (
        "import sys, contextlib, io\n"
        "from specchat.cli import main\n"
        "for args in ARGS:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(args)\n"
        "    print(' '.join(args), 'torch' in sys.modules)\n"
    ).replace("ARGS", repr(LIGHT_COMMANDS))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(LIGHT_COMMANDS) and all(line.endswith(" False") for line in lines), out.stdout


def test_pull_of_a_model_at_hand_does_not_import_torch(tiny_model_dir):
    """`specchat pull` of a model already fetched checks its tokenizer and answers in ~0.5 s: it imported torch for
    that (engine/loading.py), 2.1 s on a 2-core Xeon."""
    code = (
        "import sys, contextlib\n"
        "from specchat.cli import main\n"
        f"with contextlib.suppress(SystemExit):\n    main(['pull', {str(tiny_model_dir)!r}])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    said = out.stdout.splitlines()[-2:]
    assert said == [f"{tiny_model_dir.name}: {tiny_model_dir}", "False"], (out.stdout, out.stderr)
