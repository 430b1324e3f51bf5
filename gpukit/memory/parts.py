"""The parts of one training step's memory (`MemoryBreakdown`, measured or predicted), and the
tables and figures the lessons show of them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..report import Table, format_bytes
from .allocator import Snapshot


@dataclass
class MemoryBreakdown:
    """Bytes of one training step, measured (`breakdown`) or predicted (`estimate`).

    params, buffers, grads, optimizer_state:  what the model and optimizer keep.
    activations:  bytes saved for backward in the forward pass (autocast's low-precision
                  weight copies included), each storage once.
    saved_weight_copies: of `activations`, the bytes of parameters cast to another dtype
                  (`weight_copy_dtype`): under bf16-mixed or fp16-mixed, autocast's copy of each fp32
                  weight that a convolution or matrix product saves. They do not grow with the batch.
    total:        the peak during the step.
    at_peak:      bytes of parameters (and buffers), gradients, optimizer state and saved activations
                  alive at the moment of the peak: `parts()` shows these, and `other` is the rest of the
                  peak (temporaries such as the gradient flowing back or the optimizer's, the input batch,
                  activations recomputed by activation checkpointing),
                  never negative. Gradients and saved activations need not all be alive at the peak:
                  backward frees activations while it makes gradients, and at a peak in the optimizer
                  step every saved activation is gone (checkpointing cannot lower that peak).
    workspace:    measured on CUDA only (a property): memory held only inside an operator, the
                  peak minus the allocator's highest count after any operator. It is the scratch
                  space libraries take from the caching allocator for one call and free before
                  it returns, above all cuDNN's convolution workspaces, whose size depends on the
                  algorithm cuDNN picks (shapes, dtype, TF32 allowed or not), not on any tensor:
                  a prediction cannot count it (see layer_workspaces()).
    allocator_cache: CUDA only: reserved minus allocated at the peak.
    layers:       saved bytes per module (the innermost module running when it was saved).
    timeline:     bytes of tensor storages alive after each operator; `phases` gives the
                  index where each phase (forward, backward, optimizer step) starts.
    allocated_timeline: CUDA only: torch.cuda.memory_allocated after each operator (from the
                  step's start), to compare with `timeline` (there rounded to 512-byte blocks).
    allocator_slack: CUDA only: the most the allocator can count beyond those tensors after an
                  operator: up to 1 MiB per storage above 1 MiB alive at once (a large cached block is
                  handed out whole when 1 MiB or less would remain; small ones are cut exactly), and
                  nothing for cuBLAS, whose workspaces are taken before the step's baseline
                  (counting.allocator_slack). Inside an operator, cuDNN workspaces come on top.
    """

    batch_size: int
    device: str
    precision: str
    optimizer: str
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    activations: int
    total: int
    source: str
    allocator_cache: int | None = None
    peak_phase: str | None = None
    layers: dict[str, int] = field(default_factory=dict)
    timeline: list[int] = field(default_factory=list, repr=False)
    phases: list[tuple[str, int]] = field(default_factory=list, repr=False)
    allocated_timeline: list[int] = field(default_factory=list, repr=False)
    allocator_slack: int | None = None
    at_peak: dict[str, int] = field(default_factory=dict)
    saved_weight_copies: int = 0
    weight_copy_dtype: str | None = None

    @property
    def workspace(self) -> int | None:
        """Bytes held only inside an operator at the peak (CUDA measurements; None elsewhere)."""
        if not self.allocated_timeline:
            return None
        return self.total - max(self.allocated_timeline)

    @property
    def kept_by_forward(self) -> int:
        """Bytes the forward pass left alive for the backward (the timeline's growth over the forward): saved
        activations, what a selective activation checkpoint keeps aside from autograd, the outputs and the loss."""
        starts = dict(self.phases)
        if "forward" not in starts or "backward" not in starts:
            raise ValueError(
                "this breakdown has no timeline of its phases (a prediction): measure it with breakdown()."
            )
        before = self.timeline[starts["forward"] - 1] if starts["forward"] else 0  # the sample before its first op
        return self.timeline[starts["backward"] - 1] - before

    @property
    def phase_peaks(self) -> dict[str, int]:
        """The most bytes alive after any operator of each phase (forward, backward, optimizer step)."""
        ends = [start for _, start in self.phases[1:]] + [len(self.timeline)]
        return {name: max(self.timeline[start:end]) for (name, start), end in zip(self.phases, ends) if end > start}

    def _known_at_peak(self) -> dict[str, int]:
        if self.at_peak:
            return self.at_peak
        # Without a record of the peak (a breakdown made by hand): every part whole, as if all alive at once.
        return {
            "parameters": self.params + self.buffers,
            "gradients": self.grads,
            "optimizer state": self.optimizer_state,
            "saved activations": self.activations,
        }

    @property
    def other(self) -> int:
        """Bytes of the peak that no part alive at the peak (nor the workspace) explains."""
        return self.total - sum(self._known_at_peak().values()) - (self.workspace or 0)

    def parts(self) -> dict[str, int]:
        """The stacked categories alive at the peak, in bytes, which add up to it (the workspace and the
        allocator cache only where measured)."""
        parts = self._known_at_peak() | {"other": self.other}
        if self.workspace is not None:
            parts["workspace (inside operators)"] = self.workspace
        if self.allocator_cache is not None:
            parts["allocator cache"] = self.allocator_cache
        return parts

    def row(self) -> dict:
        """One table row in MiB."""
        mib = 2**20
        row = {"batch": self.batch_size, "precision": self.precision, "optimizer": self.optimizer}
        row |= {f"{name} (MiB)": value / mib for name, value in self.parts().items()}
        return row | {"peak (MiB)": self.total / mib}

    def notes(self) -> list[str]:
        """A line for each thing in this breakdown that surprises, said only where it applies."""
        notes = []
        peaks = self.phase_peaks
        if self.peak_phase == "optimizer step" and self.activations:
            before = max(peaks.get("forward", 0), peaks.get("backward", 0))
            freed = self.activations - self._known_at_peak()["saved activations"]
            notes.append(
                f"The peak is in the optimizer step, after backward freed {format_bytes(freed)} of the "
                f"{format_bytes(self.activations)} saved for backward: activation checkpointing or a smaller batch "
                f"cannot lower it (the forward and backward peak at {format_bytes(before)}); 'other' is what else is "
                "alive then, the optimizer's temporaries."
            )
        if self.saved_weight_copies:
            copies, rest = (
                format_bytes(self.saved_weight_copies),
                format_bytes(self.activations - self.saved_weight_copies),
            )
            cast_by = (
                "autocast casts each fp32 weight" if self.precision.endswith("-mixed") else "the model casts weights"
            )
            notes.append(
                f"{copies} of the {format_bytes(self.activations)} saved for backward are {self.weight_copy_dtype} "
                f"copies of weights: {cast_by} for its convolution or matrix product, which saves the copy for "
                f"backward. They do not grow with the batch; the activations themselves are {rest}."
            )
        return notes

    def table(self) -> Table:
        parts = self.parts() | {"peak during the step": self.total}
        rows = [
            {"part": name, "bytes": value, "size": format_bytes(value), "% of peak": 100 * value / max(self.total, 1)}
            for name, value in parts.items()
        ]
        when = f" at its peak (in the {self.peak_phase})" if self.at_peak and self.peak_phase else ""
        return Table(
            rows,
            title=f"one training step{when}, batch {self.batch_size}, {self.precision}, {self.optimizer} "
            f"({self.source})",
            notes=self.notes(),
        )

    def largest_layers(self, count: int = 5) -> Table:
        rows = [
            {"module": name, "saved (MiB)": size / 2**20, "% of activations": 100 * size / max(self.activations, 1)}
            for name, size in Counter(self.layers).most_common(count)
        ]
        return Table(rows, title=f"the {count} modules that save the most for backward")

    def plot(self, **kwargs):
        return plot_breakdowns({f"batch {self.batch_size}": self}, **kwargs)


# ---------------------------------------------------------------------------------------------
# Tables and plots


def breakdown_table(
    breakdowns: dict[str, MemoryBreakdown] | Sequence[MemoryBreakdown], title: str | None = None
) -> Table:
    """One row per breakdown or prediction, sizes in MiB."""
    items = breakdowns.items() if isinstance(breakdowns, dict) else ((None, b) for b in breakdowns)
    rows = [({"case": name} if name is not None else {}) | b.row() for name, b in items]
    return Table(rows, title=title)


_COLOURS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer state": "#55a868",
    "saved activations": "#c44e52",
    "other": "#8c8c8c",
    "workspace (inside operators)": "#8172b3",
    "allocator cache": "#d9d9d9",
}


def plot_breakdowns(breakdowns: dict[str, MemoryBreakdown], title: str = "where training memory goes"):
    """Stacked bars, one per breakdown; a black line marks each step's peak.

    The parts are those alive at the peak, so the stack reaches the peak line (a breakdown without a
    record of its peak shows every part whole, and a negative "other" is then not drawn).
    """
    from ..figures import subplots

    figure, axis = subplots(figsize=(max(4.5, 1.3 * len(breakdowns) + 2.5), 4))
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


def plot_memory_timeline(source: MemoryBreakdown | Snapshot | Sequence[int], title: str | None = None):
    """Memory after each operator (a breakdown or estimate) or allocator event (a Snapshot)."""
    from ..figures import subplots

    phases = []
    if isinstance(source, MemoryBreakdown):
        values, phases = source.timeline, source.phases
        xlabel, default = "operator (in the order they ran)", f"one training step: {source.source}"
    elif isinstance(source, Snapshot):
        values, xlabel, default = source.timeline(), "allocation or free", "one training step: CUDA memory snapshot"
    else:
        values, xlabel, default = list(source), "event", "memory over time"
    figure, axis = subplots(figsize=(8, 3.5))
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
