"""The hit-rate benchmark's report: the table it prints and the figure it saves (one panel per workload and sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ucm.eviction import PolicyName

if TYPE_CHECKING:
    from benchmarks.hit_rate_point import Point


def print_table(points: list[Point]) -> None:
    policies = list(dict.fromkeys(p.policy for p in points))
    groups: dict[tuple[str, str, float], dict[str, Point]] = {}
    for p in points:
        groups.setdefault((p.workload, p.sweep, p.capacity_frac), {})[p.policy] = p
    head = f"{'workload':<10}{'sweep':<7}{'cap':>6}{'blocks':>14} " + "".join(f"{n:>20}" for n in policies)
    print("\nhit rate % (tiered: DRAM+disk=total) | MIN = Belady, one cache of DRAM+disk blocks | inf = no eviction")
    print(head + f"{'best-LRU':>9}{'MIN':>7}{'inf':>7}{'MIN-best':>9}")
    for (workload, sweep, frac), row in groups.items():
        any_p = next(iter(row.values()))
        blocks = f"{any_p.dram_blocks}" + (f"+{any_p.disk_blocks}" if any_p.disk_blocks else "")
        cells = ""
        for name in policies:
            p = row.get(name)
            if p is None:
                cells += f"{'-':>20}"
            elif sweep == "dram":
                cells += f"{100 * p.hit_rate:>20.2f}"
            else:
                cells += f"{100 * p.dram_hits / p.accesses:>7.2f}+{100 * p.disk_hits / p.accesses:5.2f}={100 * p.hit_rate:5.2f}"
        best = max(p.hit_rate for p in row.values())
        lru = row[PolicyName.LRU.value].hit_rate if PolicyName.LRU.value in row else float("nan")
        mn, inf = any_p.belady_hits / any_p.accesses, any_p.infinite_hits / any_p.accesses
        print(
            f"{workload:<10}{sweep:<7}{frac:>6.3f}{blocks:>14} {cells}"
            f"{100 * (best - lru):>+9.2f}{100 * mn:>7.2f}{100 * inf:>7.2f}{100 * (mn - best):>9.2f}"
        )


def plot(points: list[Point], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p.workload, p.sweep) for p in points}, key=lambda k: (k[1] != "dram", k[0] != "mooncake", k[0]))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    labels = list(dict.fromkeys(p.policy for p in points))
    colors = {name: f"C{i}" for i, name in enumerate(labels)}  # one colour per policy in every panel
    for ax, (workload, sweep) in zip(axes.flat, panels):
        mine = [p for p in points if p.workload == workload and p.sweep == sweep]
        fracs = sorted({p.capacity_frac for p in mine})
        for name in labels:
            series = sorted((p.capacity_frac, p.hit_rate) for p in mine if p.policy == name)
            if series:
                ax.plot(*zip(*series), marker="o", ms=3, color=colors[name], label=name)
        ref = {p.capacity_frac: p for p in mine}
        ax.plot(fracs, [ref[f].belady_hits / ref[f].accesses for f in fracs], "k--", label="Belady MIN")
        ax.plot(fracs, [ref[f].infinite_hits / ref[f].accesses for f in fracs], "k:", label="infinite")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(fracs)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
        title = (
            f"{workload}: DRAM only"
            if sweep == "dram"
            else f"{workload}: DRAM {ref[fracs[0]].dram_blocks} blocks + disk"
        )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("DRAM capacity / working set" if sweep == "dram" else "disk capacity / working set")
        ax.set_ylabel("block hit rate (prefix)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
