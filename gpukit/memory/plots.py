"""Tables and figures of memory breakdowns, predictions and timelines."""

from __future__ import annotations

from collections.abc import Sequence

from ..report import Table, format_bytes
from .allocator import Snapshot
from .measure import MemoryBreakdown


def table(breakdowns: dict[str, MemoryBreakdown] | Sequence[MemoryBreakdown], title: str | None = None) -> Table:
    """One row per breakdown or prediction, sizes in MiB."""
    items = breakdowns.items() if isinstance(breakdowns, dict) else ((None, b) for b in breakdowns)
    rows = [({"case": name} if name is not None else {}) | b.row() for name, b in items]
    return Table(rows, title=title)


_COLOURS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
    "saved activations": "#c44e52", "other": "#8c8c8c", "allocator cache": "#d9d9d9",
}  # fmt: skip


def plot_breakdowns(breakdowns: dict[str, MemoryBreakdown], title: str = "where training memory goes"):
    """Stacked bars, one per breakdown; a black line marks each step's peak.

    A negative "other" (gradients and activations never all alive at once) is not drawn: the
    peak line then lies below the top of the stack.
    """
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(4.5, 1.3 * len(breakdowns) + 2.5), 4))
    for position, parts in enumerate(breakdowns.values()):
        bottom = 0.0
        for part, value in parts.parts().items():
            if value > 0:
                axis.bar(position, value / 2**20, bottom=bottom, color=_COLOURS[part], label=part)
                bottom += value / 2**20
        axis.hlines(
            parts.total / 2**20,
            position - 0.45,
            position + 0.45,
            colors="black",
            label="peak",
        )
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    axis.set_xticks(range(len(breakdowns)), list(breakdowns), rotation=15)
    axis.set(ylabel="MiB", title=title)
    figure.tight_layout()
    return figure


def plot_timeline(source: MemoryBreakdown | Snapshot | Sequence[int], title: str | None = None):
    """Memory after each operator (a breakdown or estimate) or allocator event (a Snapshot)."""
    import matplotlib.pyplot as plt

    phases = []
    if isinstance(source, MemoryBreakdown):
        values, phases = source.timeline, source.phases
        xlabel, default = "operator (in the order they ran)", f"one training step: {source.source}"
    elif isinstance(source, Snapshot):
        values, xlabel, default = source.timeline(), "allocation or free", "one training step: CUDA memory snapshot"
    else:
        values, xlabel, default = list(source), "event", "memory over time"
    figure, axis = plt.subplots(figsize=(8, 3.5))
    axis.plot([v / 2**20 for v in values], color="black", linewidth=1)
    ends = [start for _, start in phases[1:]] + [len(values)]
    for (name, start), end, colour in zip(phases, ends, ("#dbe9f6", "#fbe3d6", "#dff0d8")):
        axis.axvspan(start, max(end - 1, start), color=colour, label=name)
    if values:
        peak = max(range(len(values)), key=values.__getitem__)
        axis.plot(peak, values[peak] / 2**20, "v", color="#c44e52", label=f"peak {format_bytes(values[peak])}")
    axis.set(xlabel=xlabel, ylabel="MiB alive", title=title or default)
    axis.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    return figure
