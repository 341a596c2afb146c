"""Under PYTHONDONTWRITEBYTECODE the CLI keeps bytecode under $SPECCHAT_HOME/pycache (fast second starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specchat.cli import keep_bytecode


@pytest.fixture
def bytecode_state(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)


def test_bytecode_goes_under_specchat_home(bytecode_state, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    monkeypatch.delenv("SPECCHAT_NO_PYCACHE", raising=False)
    keep_bytecode()
    assert sys.pycache_prefix == str(tmp_path / "pycache") and not sys.dont_write_bytecode


def test_the_users_choices_are_kept(bytecode_state, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    monkeypatch.setenv("SPECCHAT_NO_PYCACHE", "1")
    keep_bytecode()
    assert sys.pycache_prefix is None and sys.dont_write_bytecode
    monkeypatch.delenv("SPECCHAT_NO_PYCACHE")
    monkeypatch.setattr(sys, "pycache_prefix", "/elsewhere")
    keep_bytecode()
    assert sys.pycache_prefix == "/elsewhere" and sys.dont_write_bytecode


def test_a_start_writes_the_bytecode_a_later_start_reads(tmp_path):
    env = {"SPECCHAT_HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
    code = "import specchat.cli, click, sys; print(click.__cached__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    cached = Path(out.stdout.strip())
    assert cached.is_relative_to(tmp_path / "pycache") and cached.is_file()
