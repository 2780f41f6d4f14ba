"""A linear layer's two-way kernel choice on this machine (`measured_win`): memoised per process, else read from the
`linear` cache file, else measured (ucm_kernels/cpu/calibration_store.py). The kernels that choose this way:
ucm_kernels/cpu/onednn_linear.py, ucm_kernels/cpu/q4_bf16.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from ucm_kernels.choice_memo import ChoiceMemo
from ucm_kernels.cpu.calibration_store import stored_or_measured
from ucm_kernels.cpu.choice_threads import choice_threads
from ucm_kernels.cpu.host import cpu_info, vector_flags
from ucm_kernels.cpu.native import NativeLib

WinMemo = ChoiceMemo[tuple[str, str, int, str], bool]  # `measured_win`'s answers


def measured_win(
    memo: WinMemo,
    lib: NativeLib,
    root: Path | None,
    name: str,
    field: str,
    rounds: Callable[[], Sequence[tuple[float, float]]],
    paths: tuple[str, str],
    calls: str,
    setting: str,
    logger: logging.Logger,
) -> bool:
    """Whether path `paths[0]` beat `paths[1]` in every round of `rounds()` ((first ms, second ms) each) for the
    linear-layer choice `name` on this machine: memoised, else read from the `linear` cache file under `field`, else
    measured. Rounds that disagree give the second path, stored as provisional (calibration_store). Logged once per
    process: `calls` names the calls the choice is for, `setting` what was measured (e.g. "8 rows")."""
    threads = choice_threads()
    memo_key = (str(root), lib.path.name, threads, name)

    def make() -> bool:
        tables: list[str] = []

        def run() -> tuple[bool, list[str]]:
            measured = rounds()
            picks = [first < second for first, second in measured]
            tables.append(", ".join(f"{first:.2f} vs {second:.2f} ms" for first, second in measured))
            return all(picks), [] if len(set(picks)) == 1 else [f"{paths[0]} won {sum(picks)} of {len(picks)} rounds"]

        def parse(stored: object) -> bool | None:
            wins = stored.get(field) if isinstance(stored, dict) else None
            return wins if isinstance(wins, bool) else None

        wins, where = stored_or_measured("linear", name, lib, threads, root, parse, run, lambda w: {field: w})
        measured = f" ({paths[0]} vs {paths[1]} at {setting}: {tables[0]})" if tables else ""
        logger.info(
            "CPU linear %s for %s [%s], %d thread(s): %s through %s%s (%s)",
            name, cpu_info()[0], " ".join(vector_flags()), threads, calls, paths[0] if wins else paths[1], measured,
            where,
        )  # fmt: skip
        return wins

    return memo.get_or_make(memo_key, make)
