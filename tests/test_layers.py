"""The layers of docs/architecture.md, checked on the source: which package may import which.

Imports inside `if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specchat"
SHARED = {"specchat.config", "specchat.errors", "specchat.registry", "specchat.safetensors_io"}
# package -> the specchat packages / modules it may import at run time (besides itself and SHARED)
ALLOWED = {
    "kernels": set(),
    "quant": {"specchat.kernels"},
    "engine": {"specchat.kernels", "specchat.quant"},
    "agent": {"specchat.engine.api", "specchat.engine.sequence", "specchat.engine.stats"},
    "server": {"specchat.agent", "specchat.engine.api", "specchat.engine.sequence", "specchat.engine.telemetry"},
    "ui": {
        "specchat.agent",
        "specchat.engine.api",
        "specchat.engine.sequence",
        "specchat.engine.stats",
        "specchat.engine.telemetry",
        "specchat.engine.engine",  # ui/bridge.py builds the engine it then uses through engine.api
    },
}


def runtime_imports(path: Path) -> set[str]:
    """specchat modules `path` imports, leaving out `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("specchat.")}


def allowed(package: str, module: str) -> bool:
    own = f"specchat.{package}"
    targets = ALLOWED[package] | SHARED | {own}
    return any(module == t or module.startswith(t + ".") for t in targets)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package):
    wrong = [
        f"{path.relative_to(ROOT.parent)} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module in sorted(runtime_imports(path))
        if not allowed(package, module)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nfrom specchat.engine.model import X\nif TYPE_CHECKING:\n    import specchat.ui\n"
    )
    assert runtime_imports(bad) == {"specchat.engine.model"}
    assert not allowed("kernels", "specchat.engine.model") and allowed("quant", "specchat.kernels.mxfp4")
