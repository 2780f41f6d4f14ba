"""The venv the tests run in is the lock (lock/test.txt): what CI tests is what `make run` ships, on any machine.

A machine keeps what earlier sessions installed, so without this a green run could rest on a version no fresh
install would get (transformers 4.x stayed on our machines while a new user got 5.x).
"""

from __future__ import annotations

from pathlib import Path

from launch.lock_file import PIN, differences, pins

ROOT = Path(__file__).resolve().parents[2]


def test_every_lock_pins_its_closure_with_hashes() -> None:
    for lock in sorted((ROOT / "lock").glob("*.txt")):
        text = lock.read_text()
        entries = [line for line in text.splitlines() if line and not line[0].isspace() and not line.startswith("#")]
        assert entries, f"{lock.name} pins nothing"
        for entry in entries:
            assert PIN.match(entry) and entry.endswith("\\"), f"{lock.name}: not an exact pin with hashes: {entry!r}"
    assert pins(ROOT / "lock" / "serve.txt")["torch"] == "2.13.0+cpu"


def test_the_locks_agree_where_they_overlap() -> None:
    serve, test = pins(ROOT / "lock" / "serve.txt"), pins(ROOT / "lock" / "test.txt")
    assert {n: v for n, v in test.items() if n in serve} == serve, "test.txt moved a version serve.txt pins"


def test_this_venv_has_exactly_the_locked_versions() -> None:
    wrong = differences(ROOT / "lock" / "test.txt")
    assert wrong == {}, "installed versions differ from lock/test.txt (locked, installed); `make install-test`"
