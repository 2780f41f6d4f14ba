"""docs/benchmarks.md is a reference, not a diary; its history lives in docs/history/benchmarks.json.

The page's convention, checked here: one `## <module>: ...` section per benchmark, each with the command in a fenced
code block that runs that module, a line starting `Target:`, and a `Host:` line (CPU and date, or "not recorded")
before its first table. Every `python -m benchmarks.X` the page names is a real module. The history file is a list
of verbatim records of the old page's sections, each naming its benchmark.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
HISTORY = ROOT / "docs" / "history" / "benchmarks.json"
MAX_LINES = 450

MODULE_RE = re.compile(r"python -m benchmarks\.([A-Za-z_][A-Za-z0-9_]*)")
DATE_RE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HEX_RE = re.compile(r"^[0-9a-f]{7,40}$")
RECORD_KEYS = {"benchmark": str, "host": str, "date": str, "commits": list, "title": str, "markdown": str}


def _benchmark_modules() -> set[str]:
    bench = ROOT / "benchmarks"
    files = {p.stem for p in bench.glob("*.py") if p.stem != "__init__"}
    packages = {p.name for p in bench.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return files | packages


def _sections(text: str) -> dict[str, list[str]]:
    """`##` title -> its lines (up to the next `##`)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            assert title not in sections, f"two sections titled {title!r}"
            current = sections[title] = []
        elif current is not None:
            current.append(line)
    return sections


def _fenced_blocks(lines: list[str]) -> list[str]:
    blocks: list[str] = []
    inside: list[str] | None = None
    for line in lines:
        if line.startswith("```"):
            if inside is None:
                inside = []
            else:
                blocks.append("\n".join(inside))
                inside = None
        elif inside is not None:
            inside.append(line)
    assert inside is None, "a fenced code block is not closed"
    return blocks


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def history() -> list[dict[str, object]]:
    data = json.loads(HISTORY.read_text(encoding="utf-8"))
    assert isinstance(data, list) and data, "the history is a non-empty JSON list"
    return data


def test_benchmarks_doc_is_short(doc: str) -> None:
    n = len(doc.splitlines())
    assert n < MAX_LINES, f"docs/benchmarks.md has {n} lines (< {MAX_LINES}): move dated runs to {HISTORY.name}"


def test_every_named_module_exists(doc: str) -> None:
    named = set(MODULE_RE.findall(doc))
    assert named, "the page names no `python -m benchmarks.X` command"
    missing = sorted(named - _benchmark_modules())
    assert not missing, f"docs/benchmarks.md runs modules that benchmarks/ does not have: {missing}"


def test_intro_says_where_history_lives(doc: str) -> None:
    intro = doc.split("\n## ", 1)[0]
    assert "docs/history/benchmarks.json" in intro


def test_every_section_has_command_target_and_host(doc: str) -> None:
    sections = _sections(doc)
    assert sections, "no `##` sections"
    modules = _benchmark_modules()
    problems: list[str] = []
    for title, lines in sections.items():
        module = title.split(":", 1)[0].strip()
        if module not in modules:
            problems.append(f"{title!r}: the title does not start with a module of benchmarks/ ('<module>: ...')")
        commands = [m for block in _fenced_blocks(lines) for m in MODULE_RE.findall(block)]
        if module not in commands:
            problems.append(f"{title!r}: no fenced code block runs `python -m benchmarks.{module}`")
        if not any(re.match(r"Targets?:", line) for line in lines):
            problems.append(f"{title!r}: no line starting with 'Target:'")
        hosts = [i for i, line in enumerate(lines) if line.startswith("Host:")]
        if not hosts:
            problems.append(f"{title!r}: no 'Host:' line")
        for i in hosts:
            # a Host paragraph may wrap: its date can sit on the next line
            paragraph = " ".join(lines[i : i + 3])
            if not DATE_RE.search(paragraph) and "not recorded" not in paragraph:
                problems.append(f"{title!r}: a Host line names no date (or 'not recorded'): {lines[i]!r}")
        tables = [i for i, line in enumerate(lines) if line.startswith("|---")]
        if tables and (not hosts or hosts[0] > tables[0]):
            problems.append(f"{title!r}: a table comes before any 'Host:' line")
    assert not problems, "\n".join(problems)


def test_history_records_are_complete(history: list[dict[str, object]]) -> None:
    modules = _benchmark_modules() | {"overview"}
    for n, record in enumerate(history):
        assert isinstance(record, dict), f"record {n} is not an object"
        assert set(record) == set(RECORD_KEYS), f"record {n} keys {sorted(record)} != {sorted(RECORD_KEYS)}"
        for key, kind in RECORD_KEYS.items():
            assert isinstance(record[key], kind), f"record {n}: {key} is not a {kind.__name__}"
        markdown = str(record["markdown"])
        title = str(record["title"])
        assert markdown.strip(), f"record {n} ({title!r}) has no markdown"
        assert title, f"record {n} has no title"
        first = markdown.splitlines()[0]
        assert re.fullmatch(r"#{1,6} " + re.escape(title), first), f"record {n}: markdown does not open with its title"
        assert record["benchmark"] in modules, f"record {n}: unknown benchmark {record['benchmark']!r}"
        commits = record["commits"]
        assert isinstance(commits, list)
        for commit in commits:
            assert isinstance(commit, str) and HEX_RE.match(commit), f"record {n}: {commit!r} is not a commit id"
            assert commit in title, f"record {n}: commit {commit} is not named in its heading"
