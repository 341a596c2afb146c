"""The layers of docs/architecture.md, checked on the source: which package may import which, and that only a
module that imports Triton itself imports one that does when it loads (the CPU path never imports Triton; the
processes that check it: tests/test_cpu_without_triton.py).

Imports inside `if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specchat"
SHARED = {"specchat.config", "specchat.errors", "specchat.registry", "specchat.safetensors_io", "specchat.writes"}
SHARED |= {"specchat.derived_folders"}  # (registry.py's)
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


def load_time_imports(path: Path) -> set[str]:
    """Modules `path` imports when it is imported: its module-level statements and class bodies, not function
    bodies or `if TYPE_CHECKING:` blocks. `from package import name` counts package.name where that is a module."""
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}"))
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                visit(node.orelse)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text()).body)
    return names


def module_file(name: str) -> Path | None:
    """The source of specchat module `name` (a package's __init__.py), None for anything else."""
    if not name.startswith("specchat."):
        return None
    base = ROOT.parent.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imports_triton(names: set[str]) -> bool:
    return any(name == "triton" or name.startswith("triton.") for name in names)


def test_only_triton_modules_load_triton_modules():
    """A module that imports Triton when it loads is loaded, by another module's load, only from modules that import
    Triton themselves: the rest (the CPU path, the host side of each kernel) reach a kernel's module inside the
    function that launches it. Triton lives in kernels/ only."""
    modules = {
        ".".join(path.relative_to(ROOT.parent).with_suffix("").parts): load_time_imports(path)
        for path in sorted(ROOT.rglob("*.py"))
    }
    triton_modules = {name for name, imported in modules.items() if imports_triton(imported)}
    assert "specchat.kernels.attention_triton" in triton_modules  # (the check sees them)
    assert all(name.startswith("specchat.kernels.") for name in triton_modules), sorted(triton_modules)
    wrong = [
        f"{name} imports {target} when it loads"
        for name, imported in modules.items()
        if name not in triton_modules
        for target in sorted(imported & triton_modules)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nfrom specchat.engine.model import X\nif TYPE_CHECKING:\n    import specchat.ui\n"
    )
    assert runtime_imports(bad) == {"specchat.engine.model"}
    assert not allowed("kernels", "specchat.engine.model") and allowed("quant", "specchat.kernels.mxfp4")
    lazy = tmp_path / "lazy.py"
    lazy.write_text(
        "from specchat.kernels import fused, fused_triton\n"
        "class A:\n    import triton\n"
        "def launch():\n    from specchat.kernels import attention_triton\n"
    )
    assert load_time_imports(lazy) == {
        "specchat.kernels",
        "specchat.kernels.fused",
        "specchat.kernels.fused_triton",
        "triton",
    }
