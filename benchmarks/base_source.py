"""An earlier tree's C kernel sources, for benchmarks that build them beside this checkout's (cpu_gemv.py,
cpu_attention_ab.py). The text is what the module itself built at that tree (`<module>.C_SOURCE`, however it was
assembled: a string in the module before 2026-12-07, files of kernels/csrc/ since), read by importing it there in
a child process, so neither layout is parsed by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def module_source(tree: Path, module: str, name: str = "C_SOURCE") -> str:
    """`specchat.kernels.<module>.<name>` as the tree at `tree` (a folder holding its specchat/) defines it."""
    code = f"import sys; from specchat.kernels import {module} as m; sys.stdout.write(m.{name})"
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{tree}: specchat.kernels.{module}.{name} did not load:\n{done.stderr.strip()}")
    return done.stdout


def tree_at(rev: str, into: Path) -> Path:
    """The revision's specchat/ (its data left out) unpacked into `into`, which is returned."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "specchat"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "--exclude=specchat/data", "-C", str(into)], input=archive, check=True)
    return into
