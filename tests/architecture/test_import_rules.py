"""The folder list is the architecture: these rules keep the packages layered (docs/architecture.md).

router/ → protocol/ → prefill_node/, decode_node/ → node/ → engine/ → connector/ → ucm/, with ucm_kernels/ underneath,
common/ (the nouns every side shares) under all of them and launch/ beside. The rules are read from the page's table
"Who may import whom", so the page and this test cannot drift apart. Imports are read from the source (lazy ones
inside functions count too), so a rule cannot be dodged by importing late; the torch rule is also checked at run time,
since it is about what loads transitively.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROLES = {"prefill_node", "decode_node"}


@dataclass(frozen=True)
class Rule:
    """One package's row of the table."""

    may_import: set[str] | None  # the packages of ours it may import; None: any ("anything")
    never: set[str]  # the packages of ours it must never import
    torch_free: bool  # "torch" in the "never" column


def read_table(text: str) -> dict[str, Rule]:
    """The "Who may import whom" table: package -> its rule. A cell names packages in backquotes (`router` or
    `router/`); in the "never" column, "the roles", "each other" (the row's other packages), "everything of ours"
    and "torch" are words of the rule too."""
    section = text.split("## Who may import whom", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append(cells)
    ours = {name for cells in rows for name in _named(cells[0])}

    def packages(cell: str) -> set[str]:
        return {name for name in _named(cell) if name in ours}

    rules = {}
    for package_cell, may_cell, never_cell in rows:
        row = packages(package_cell)
        for package in row:
            never = packages(never_cell)
            never |= ROLES if "the roles" in never_cell else set()
            never |= row - {package} if "each other" in never_cell else set()
            never |= ours - {package} if "everything of ours" in never_cell else set()
            may = None if may_cell.startswith("anything") else packages(may_cell)
            rules[package] = Rule(may, never, re.search(r"\btorch\b", never_cell) is not None)
    return rules


def _named(cell: str) -> list[str]:
    return re.findall(r"`(\w+)/?`", cell)


RULES = read_table(ARCHITECTURE.read_text())
OURS = set(RULES)
# package -> the packages of ours it must never import (docs/architecture.md's "never" column)
FORBIDDEN = {package: rule.never for package, rule in RULES.items() if rule.never}
# package -> the packages of ours it may import (the "may import" column); launch/ may import any
MAY_IMPORT = {package: rule.may_import for package, rule in RULES.items() if rule.may_import is not None}
TORCH_FREE = sorted(package for package, rule in RULES.items() if rule.torch_free)


def test_the_table_reader_reads_the_page() -> None:
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert top_level <= OURS, "a package of ours has no row in docs/architecture.md's import table"
    assert RULES["ucm_kernels"] == Rule(set(), OURS - {"ucm_kernels"}, False)
    assert RULES["decode_node"].never == {"prefill_node", "router", "launch"}
    assert RULES["launch"].may_import is None
    assert {"router", "protocol", "common"} <= set(TORCH_FREE)


def test_the_table_reader_sees_each_word_of_a_rule() -> None:
    page = """## Who may import whom
| package | may import (of ours) | never |
|---|---|---|
| `a/` | nothing | torch, everything of ours |
| `b/`, `c/` | `a` (its nouns), `d` | each other, the roles |
| `d/` | anything | — |

## Next
| `e/` | `a` | `b` |
"""
    rules = read_table(page)
    assert set(rules) == {"a", "b", "c", "d"}
    assert rules["a"] == Rule(set(), {"b", "c", "d"}, True)
    assert rules["b"] == Rule({"a", "d"}, {"c"} | ROLES, False)
    assert rules["d"] == Rule(None, set(), False)


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


def test_torch_free_packages_never_load_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for pkg in TORCH_FREE
        for p in (ROOT / pkg).rglob("*.py")
    )
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", f"importing {', '.join(TORCH_FREE)} loaded torch"


def test_the_rule_reader_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from engine.llm import LLM\n    import router.app\n")
    assert imported_packages(module) == {"engine", "router"}
