"""What a wheel of the project holds: a non-editable install (`pip install .`, a wheel) runs from site-packages,
where nothing of the repository beside the package is."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="building a wheel needs setuptools")
def test_a_wheel_holds_the_model_registry_and_the_packages_data(tmp_path):
    """The registry (models.toml at the repository's root) was read from beside the package, so an installed wheel
    had none and every command that names a model failed; specchat/models.toml links to it and wheels copy it. The
    CPU kernels' C files (kernels/csrc/) are read from beside the package too."""
    source = tmp_path / "source"  # a copy, so that no build/ folder left in the checkout stands in for the package
    shutil.copytree(ROOT / "specchat", source / "specchat", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "models.toml"):
        shutil.copy2(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("specchat-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert archive.read("specchat/models.toml") == (ROOT / "models.toml").read_bytes()
        c_files = sorted((ROOT / "specchat/kernels/csrc").iterdir())  # the CPU kernels' C, compiled at first use
        assert any(c_file.suffix == ".c" for c_file in c_files)
        for c_file in c_files:
            assert archive.read(f"specchat/kernels/csrc/{c_file.name}") == c_file.read_bytes()
    assert "specchat/ui/specchat.tcss" in names
    assert any(name.startswith("specchat/data/") for name in names)
