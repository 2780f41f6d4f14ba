"""The folder list is the architecture: these rules keep the packages layered (docs/architecture.md).

router/ → protocol/ → prefill_node/, decode_node/ → node/ → engine/ → connector/ → ucm/, with ucm_kernels/ underneath
and launch/ beside. Imports are read from the source (lazy ones inside functions count too), so a rule cannot be
dodged by importing late; the torch rule is also checked at run time, since it is about what loads transitively.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "engine",
    "ucm_kernels",
    "ucm",
    "connector",
    "protocol",
    "node",
    "prefill_node",
    "decode_node",
    "router",
    "launch",
}

# package -> the packages of ours it must never import
FORBIDDEN: dict[str, set[str]] = {
    "ucm_kernels": OURS - {"ucm_kernels"},
    "protocol": OURS - {"protocol"},
    "ucm": {"engine", "connector", "node", "prefill_node", "decode_node", "router", "launch"},
    "engine": {"node", "prefill_node", "decode_node", "router", "launch"},
    "connector": {"node", "prefill_node", "decode_node", "router", "launch"},
    "node": {"prefill_node", "decode_node", "router", "launch"},
    "prefill_node": {"decode_node", "router", "launch"},
    "decode_node": {"prefill_node", "router", "launch"},
    "router": {"node", "prefill_node", "decode_node", "launch"},
}
# package -> the packages of ours it may import (docs/architecture.md's "may import" column); launch/ may import any
MAY_IMPORT: dict[str, set[str]] = {
    "protocol": set(),
    "router": {
        "protocol",
        "ucm",
        "engine",
    },  # engine's torch-free modules only: test_router_and_protocol_never_load_torch
    "prefill_node": {"node", "engine", "protocol", "connector"},
    "decode_node": {"node", "engine", "protocol", "connector"},
    "node": {"engine", "connector", "protocol", "ucm", "ucm_kernels"},
    "engine": {"connector", "ucm_kernels", "ucm", "protocol"},
    "connector": {"engine", "ucm_kernels", "ucm"},
    "ucm": {"protocol"},
    "ucm_kernels": set(),
}
TORCH_FREE = ["router", "protocol"]


def imported_packages(path: Path) -> set[str]:
    """Top-level package names a module imports, at any depth of its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(path) & FORBIDDEN[package]
        if package in TORCH_FREE and "torch" in imported_packages(path):
            bad.add("torch")
        found += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad)]
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    assert violations(package) == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_imports_only_what_its_row_may_import(package: str) -> None:
    found = {
        str(path.relative_to(ROOT)): sorted(extra)
        for path in sorted((ROOT / package).rglob("*.py"))
        if (extra := (imported_packages(path) & OURS) - MAY_IMPORT[package] - {package})
    }
    assert found == {}, f"imports beyond docs/architecture.md's row for {package}/"


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ours (of `modules`) that a module imports by name, at any depth of its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from package import module`
    return names & modules


def mutual_imports(root: Path = ROOT) -> list[tuple[str, str]]:
    """Pairs of our modules that import each other (lazily or for type checking too): a split that did not separate."""
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for package in [*OURS, "benchmarks"]
        for p in (root / package).rglob("*.py")
    }
    graph = {name: module_imports(path, set(paths)) - {name} for name, path in paths.items()}
    return sorted({(a, b) for a, deps in graph.items() for b in deps if a < b and a in graph[b]})


def test_no_two_modules_import_each_other() -> None:
    assert mutual_imports() == []


def test_the_mutual_import_reader_sees_a_cycle(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("from engine.b import x\n")
    (tmp_path / "engine" / "b.py").write_text("def f():\n    from engine import a\n")
    assert mutual_imports(tmp_path) == [("engine.a", "engine.b")]


def test_router_and_protocol_never_load_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for pkg in TORCH_FREE
        for p in (ROOT / pkg).rglob("*.py")
    )
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "importing router/ and protocol/ loaded torch"


def test_the_rule_reader_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from engine.llm import LLM\n    import router.app\n")
    assert imported_packages(module) == {"engine", "router"}
