"""The CPU path never imports Triton (docs/architecture.md): `specchat --help` and CPU generations in fresh
processes, with Triton blocked as where it is not installed (macOS, Windows), and without the block leaving it
unloaded. tests/test_layers.py checks the same on the source: no module loads a Triton one but another that does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specchat.config import EngineConfig
from specchat.kernels import cpu_build
from tests.conftest import save_tiny_hf
from tests.engine.test_drafters import random_heads

ROOT = Path(__file__).resolve().parent.parent
# run first in the child: `import triton` fails as where the package is not installed
BLOCK_TRITON = """
import sys


class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
"""
# the `specchat` command, then whether Triton was loaded (on stderr's last line)
RUN_SPECCHAT = """
import sys

from specchat.cli import main

try:
    main(sys.argv[1:])
except SystemExit as done:
    status = done.code
print(f"triton loaded: {'triton' in sys.modules}", file=sys.stderr)
sys.exit(status)
"""


def specchat(args: list[str], block: bool, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`specchat *args` in a fresh Python (Triton blocked or not), outside the Triton interpreter."""
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    script = (BLOCK_TRITON if block else "") + RUN_SPECCHAT
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> dict[str, str]:
    """A $SPECCHAT_HOME of the module's own, so that the tiny model's caches stay out of the user's; the C kernels'
    build (~20 s) is the caller's, linked in."""
    path = tmp_path_factory.mktemp("specchat-home")
    cpu_build.kernel_dir().mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(cpu_build.kernel_dir(), target_is_directory=True)
    return {"SPECCHAT_HOME": str(path)}


@pytest.fixture(scope="module")
def model_and_heads(tmp_path_factory, home: dict[str, str]) -> tuple[Path, Path]:
    """A tiny model of head_dim 32 (MXFP4 pages take whole 32-element blocks) and random draft heads for it."""
    from specchat.engine.engine import Engine

    model_dir = save_tiny_hf(
        tmp_path_factory.mktemp("tiny-hd32"), {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    heads = model_dir / "heads.safetensors"
    random_heads(Engine.load(EngineConfig(model=str(model_dir), device="cpu", dtype="float32")).model).save(heads, {})
    return model_dir, heads


def test_help_runs_without_triton(home: dict[str, str]):
    run = specchat(["--help"], block=True, env=home)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Usage:" in run.stdout and run.stderr.endswith("triton loaded: False\n")


@pytest.mark.parametrize(
    ("block", "c_kernels"),
    [(True, "1"), (True, "0"), (False, "1")],
    ids=["blocked-c-kernels", "blocked-torch-path", "installed-c-kernels"],
)
def test_a_cpu_generation_with_drafts_and_mxfp4_never_imports_triton(model_and_heads, home, block, c_kernels):
    """n-gram + heads drafts over MXFP4 weights and MXFP4 pages, on the C kernels and on the torch path (what
    SPECCHAT_CPU_KERNELS=0 and a CPU other than Linux's run)."""
    model_dir, heads = model_and_heads
    prompt = "one two three " * 4  # repeats: the n-gram drafter finds matches
    args = ["generate", str(model_dir), "-p", prompt, "--max-tokens", "12", "--device", "cpu", "--json"]
    args += ["--weights", "mxfp4", "--kv", "mxfp4", "--drafter", f"ngram+heads:{heads}"]
    run = specchat(args, block, {**home, "SPECCHAT_CPU_KERNELS": c_kernels})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.endswith("triton loaded: False\n"), run.stderr[-3000:]
    stats = json.loads(run.stdout.splitlines()[0])["stats"]
    assert stats["completion_tokens"] == 12 and stats["drafted"] > 0
    assert stats["memory"]["weights_format"] == "mxfp4" and stats["memory"]["kv_format"] == "mxfp4"


@pytest.mark.slow
def test_the_default_model_generates_without_triton(default_model_path: Path):
    """`specchat generate` as a user on a machine without Triton runs it: the default model, its default drafter."""
    args = ["generate", "-p", "Write a Python function that reverses a list.", "--max-tokens", "32", "--device", "cpu"]
    run = specchat([*args, "--json"], block=True, env={})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[0])["stats"]["completion_tokens"] > 0
