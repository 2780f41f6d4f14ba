"""Where the CPU calibrations live, and when a measurement may be stored there.

One JSON file per kind and key (`calibration_key`: the CPU model and flags, the native library's file name, torch's
version and ISA caps, the host's thread count: choice_threads.py), under `<cache dir>/kernels/`. When any part of the
key changes the hash names another file, so a stale choice is never read. `stored_or_measured` reads an entry or
measures it: one process at a time (a lock file beside the cache file, so nodes that start together do not time each
other's load), at the host's thread count, and stores the result as measured only when its rounds agreed and no
other process took cores meanwhile (`CpuClock`).
A result measured under load is stored as provisional, and every later process takes it as it is: kernels differ in
their order of operations, and a process that measured again could pick another kernel than one already serving (a
served node's greedy text must equal an in-process engine's; CI saw them differ when a clean measurement replaced a
provisional choice one of them had taken). Deleting the file (or a new library build, another key) measures again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from ucm_kernels.cache_dir import cache_dir
from ucm_kernels.cpu.choice_threads import measuring_at
from ucm_kernels.cpu.host import CpuClock, cpu_info, torch_isa
from ucm_kernels.cpu.native import NativeLib

log = logging.getLogger(__name__)
T = TypeVar("T")

# A measurement is stored only if other processes took at most this many cores on average meanwhile (the machine's
# busy time less this process's CPU time, host.CpuClock); beyond it the timings say more about the sharing than
# about the kernels (two nodes that start together calibrate at once).
OTHERS_MAX_CORES = 0.25
FILE_VERSION = 4  # 4: skinny rows by the summed saving; 3: against oneDNN too; 2: stored only when rounds agree


def calibration_key(lib: NativeLib, threads: int) -> dict[str, object]:
    model, flags = cpu_info()
    return {"cpu": model, "flags": flags, "machine": platform.machine(), "library": lib.path.name,
            "torch": torch.__version__, "torch_isa": torch_isa(), "threads": threads}  # fmt: skip


def key_file(kind: str, key: dict[str, object], root: Path | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root if root is not None else cache_dir()) / "kernels" / f"{kind}-{digest}.json"


@dataclass(frozen=True)
class Sections:
    """A cache file's two sections, when the file is ours (same version and key); else both empty."""

    entries: dict[str, dict]  # measured on a quiet CPU
    provisional: dict[str, dict]  # measured under load, taken as they are (module doc)


def read_sections(path: Path, key: dict[str, object]) -> Sections:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return Sections({}, {})
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or data.get("key") != key:
        return Sections({}, {})
    entries, provisional = data.get("entries"), data.get("provisional")
    return Sections(entries if isinstance(entries, dict) else {}, provisional if isinstance(provisional, dict) else {})


def write_entry(path: Path, key: dict[str, object], name: str, entry: dict, provisional: bool = False) -> None:
    """Add one entry (provisional: to the entries measured under load); written to a temporary file and renamed, so
    concurrent readers see an old or a new file. A stored entry drops the provisional one of its name."""
    found = read_sections(path, key)
    entries, aside = found.entries, found.provisional
    if provisional:
        aside[name] = entry
    else:
        entries[name] = entry
        aside.pop(name, None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": FILE_VERSION, "key": key, "entries": entries, "provisional": aside}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache costs a measurement per process, nothing else
        log.warning("could not store the CPU calibration in %s: %s", path, e)


@dataclass(frozen=True)
class Source:
    """Where a calibrated value came from, for the log line."""

    path: Path
    measured: bool
    seconds: float = 0.0
    under_load: tuple[str, ...] = ()  # measured here: why it was stored as provisional (rounds disagreed, other load)
    read_provisional: bool = False  # read from the file's provisional section

    @property
    def provisional(self) -> bool:
        """Measured under load, here or by an earlier process: delete the file to measure again."""
        return self.read_provisional or bool(self.under_load)

    def __str__(self) -> str:
        again = f"; delete {self.path} to measure again"
        if not self.measured:
            return f"from {self.path}" + (f", provisional (measured under load){again}" if self.provisional else "")
        if not self.under_load:
            return f"measured in {self.seconds:.2f} s; stored in {self.path}"
        return (
            f"measured in {self.seconds:.2f} s under load: {'; '.join(self.under_load)}; stored as provisional{again}"
        )


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """One process at a time measures for a cache file: two nodes starting together would otherwise each time the
    kernels on half the cores and store what the sharing decided. Without a usable lock file, no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


PIN_ENV = "UCM_PIN"  # a file from `ucm-serve env --pin FILE`: its choices are taken before any cache file or timing


@dataclass(frozen=True)
class Pin:
    """One calibrated choice as `ucm-serve env --pin` writes it: what a cache file holds, less the host key."""

    kind: str  # the cache file's kind: calibration, linear, dtype
    threads: int
    name: str  # the entry's name in that file
    entry: object


def stored_choices(root: Path | None = None) -> list[tuple[Path, dict[str, object], Pin]]:
    """Every choice in this cache dir's calibration files, with the file and its key (host, library, threads)."""
    found = []
    for path in sorted(((root if root is not None else cache_dir()) / "kernels").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("key"), dict):
            continue
        key, kind = data["key"], path.stem.rsplit("-", 1)[0]
        for name, entry in (data.get("entries") or {}).items():
            found.append((path, key, Pin(kind, int(key.get("threads", 0)), name, entry)))
    return found


@functools.lru_cache(maxsize=4)
def _read_pins(path: str) -> dict[tuple[str, int, str], object]:
    try:
        data = json.loads(Path(path).read_text())
        return {(p["kind"], int(p["threads"]), p["name"]): p["entry"] for p in data["choices"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{PIN_ENV}={path} is not a pin file from `ucm-serve env --pin`: {e}") from None


def pinned(kind: str, threads: int, name: str) -> tuple[object, Path] | None:
    """The pinned entry for this choice and the pin file, when $UCM_PIN names one that has it."""
    path = os.environ.get(PIN_ENV, "").strip()
    if not path:
        return None
    pins = _read_pins(path)
    return (pins[(kind, threads, name)], Path(path)) if (kind, threads, name) in pins else None


def stored_or_measured(
    file_kind: str,
    name: str,
    lib: NativeLib,
    threads: int,
    root: Path | None,
    parse: Callable[[object], T | None],
    measure_fn: Callable[[], tuple[T, list[str]]],
    encode: Callable[[T], dict[str, object]],
) -> tuple[T, Source]:
    """Entry `name` of this machine's `file_kind` cache file where `parse` accepts it (a provisional one too), else
    `measure_fn()`'s (value, what its rounds disagreed on), measured by one process at a time and stored as measured
    when the rounds agreed on everything and no other process took cores meanwhile, else as provisional (module
    doc). The caller memoises and logs."""
    pin = pinned(file_kind, threads, name)
    if pin is not None and (found := parse(pin[0])) is not None:
        return found, Source(pin[1], measured=False)
    key = calibration_key(lib, threads)
    path = key_file(file_kind, key, root)
    stored = _stored(path, key, name, parse)
    if stored is not None:
        return stored
    with file_lock(path):
        stored = _stored(path, key, name, parse)  # stored by the process that held the lock before us
        if stored is not None:
            return stored
        start = CpuClock.now()
        with measuring_at(threads):
            value, disagreed = measure_fn()
        end = CpuClock.now()
        others = end.others_cores_since(start)
        under_load = [f"rounds disagreed on {', '.join(disagreed)} (other load on the CPU?)"] if disagreed else []
        if others is not None and others > OTHERS_MAX_CORES:
            under_load.append(f"other processes took {others:.2f} cores meanwhile")
        write_entry(path, key, name, encode(value), provisional=bool(under_load))
    seconds = end.wall_s - start.wall_s
    return value, Source(path, True, seconds, tuple(under_load))


def _stored(
    path: Path, key: dict[str, object], name: str, parse: Callable[[object], T | None]
) -> tuple[T, Source] | None:
    """The file's entry `name` where `parse` accepts it, measured or else provisional, with its source."""
    sections = read_sections(path, key)
    for provisional, entries in ((False, sections.entries), (True, sections.provisional)):
        found = parse(entries.get(name))
        if found is not None:
            return found, Source(path, measured=False, read_provisional=provisional)
    return None
