"""A training step's time on each GPU from a roofline, and the plan's rows.

A step takes at least as long as its slowest limit, so the prediction is the longest of three times: its FLOPs at the
GPU's dense peak times a stated MFU, its memory traffic (`step_traffic`) at the GPU's bandwidth, and its kernel
launches (`count_kernels`) at LAUNCH_SECONDS each. `_row` gives one GPU's answer; `Plan` holds them all, as a table
and as cost against hours with the Pareto frontier.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn

from ..memory.parts import MemoryBreakdown
from ..report import Table, format_bytes
from ..step import Loss, forward_backward, split_batch
from .gpus import GPU, get_gpu

# Seconds the host needs to launch one CUDA kernel in eager PyTorch (dispatch plus launch): a few
# microseconds; 5 µs is a typical figure. Small models are bound by it, not by FLOPs: the GPU waits
# for the next kernel. CUDA graphs and torch.compile remove most of it.
LAUNCH_SECONDS = 5e-6


def step_traffic(memory: MemoryBreakdown) -> int:
    """Bytes a training step moves to and from device memory, at least: activations written in the
    forward and read in the backward (2×), parameters read in forward and backward and written by
    the optimizer (3×), gradients written and read (2×), optimizer state read and written (2×).
    Kernels re-read intermediate tensors too, so real traffic is higher: a lower bound."""
    return 2 * memory.activations + 3 * memory.params + 2 * memory.grads + 2 * memory.optimizer_state


def count_kernels(model: nn.Module, batch, loss_fn=None) -> int:
    """Operators of one forward and backward that compute (views excluded): about one CUDA kernel
    each in eager mode. Counted on a copy of the model on the meta device (nothing runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.count += 1
            return func(*args, **(kwargs or {}))

    meta_model = copy.deepcopy(model).to("meta")
    meta_batch = split_batch(batch).map(lambda tensor: tensor.to("meta"))
    with Counter() as counter:
        forward_backward(meta_model, meta_batch, Loss(loss_fn, check_targets=False))
    return counter.count


@dataclass
class PlanRow:
    """One GPU's answer. Times in seconds, memory in bytes, cost in US$."""

    gpu: str
    memory_total: int
    usable: int  # memory less the margin
    needed: int  # predicted peak at the plan's batch size
    fits: bool
    largest_batch: int  # the largest batch whose step fits `usable` (0: not even one example)
    step_time: float | None  # None: the GPU has no tensor cores for this precision
    bound: str | None  # "compute", "memory" or "launch": which roof limits the step
    hours: float | None
    price: float | None  # US$ per GPU-hour
    cost: float | None  # US$ for the run
    pareto: bool = False  # no other GPU is both faster and cheaper

    def as_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "fits": self.fits,
            "needs": format_bytes(self.needed),
            "usable": format_bytes(self.usable),
            "largest batch": self.largest_batch,
            "step ms": None if self.step_time is None else self.step_time * 1e3,
            "bound": self.bound,
            "hours": self.hours,
            "$/GPU-h": self.price,
            "cost $": self.cost,
            "Pareto": self.pareto,
        }


@dataclass
class Plan:
    """What `plan` found: one PlanRow per GPU, the quantities behind them, and the check on this machine."""

    rows: list[PlanRow]
    batch_size: int
    steps: int
    precision: str
    optimizer: str
    margin: float
    flops: int  # per step at batch_size
    traffic: int  # bytes per step at batch_size (a lower bound, see step_traffic)
    kernels: int  # kernel launches per step (forward and backward; see count_kernels)
    memory: MemoryBreakdown  # the prediction at batch_size (for CUDA)
    mfu: float
    mfu_source: str
    prices_source: str
    check: dict = field(default_factory=dict)  # this machine: a step at batch_size predicted, and measured

    def row(self, gpu: str) -> PlanRow:
        name = get_gpu(gpu).name
        return next(row for row in self.rows if row.gpu == name)

    @property
    def pareto(self) -> list[PlanRow]:
        """The GPUs on the cost–time frontier, fastest first."""
        return sorted((row for row in self.rows if row.pareto), key=lambda row: row.hours)

    def table(self) -> Table:
        title = (
            f"batch {self.batch_size}, {self.steps:,} steps, {self.precision}, {self.optimizer}: "
            f"{self.flops / 1e9:.3g} GFLOP, ≥ {format_bytes(self.traffic)} moved and {self.kernels} kernels per step "
            f"({LAUNCH_SECONDS * 1e6:g} µs each), {self.margin:.0%} memory margin. Step times, hours and costs rest on "
            f"one MFU, {self.mfu:.0%} ({self.mfu_source}), assumed for every GPU: {self._mfu_caveat()}"
        )
        return Table([row.as_dict() for row in self.rows], title=title)

    def _mfu_caveat(self) -> str:
        if self.check:
            return f"measured on {self.check['device']} only, not on the other GPUs of the table"
        return "measured on none of them"

    def check_table(self) -> Table:
        """This machine: the step time the model predicts against the one measured."""
        return Table([self.check], title="the prediction checked on this machine") if self.check else Table([])

    def __str__(self) -> str:
        return "\n\n".join(str(table) for table in (self.table(), self.check_table()) if len(table))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "".join(table._repr_html_() for table in (self.table(), self.check_table()) if len(table))

    def plot(self):
        """Cost of the run against hours to train, one point per GPU that fits; the frontier joined."""
        from ..figures import subplots

        shown = [row for row in self.rows if row.cost is not None]
        figure, axis = subplots(figsize=(6.5, 4.5))
        for row in shown:
            axis.scatter(row.hours, row.cost, color="C3" if row.pareto else "C0", zorder=3)
            axis.annotate(row.gpu, (row.hours, row.cost), textcoords="offset points", xytext=(4, 4), fontsize=8)
        frontier = self.pareto
        if frontier:
            axis.plot(
                [r.hours for r in frontier],
                [r.cost for r in frontier],
                "--",
                color="C3",
                label="Pareto frontier (nothing both faster and cheaper)",
            )
            axis.legend(fontsize=8)
        axis.set(
            xlabel="hours to train",
            ylabel="cost of the run (US$)",
            xscale="log",
            yscale="log",
            title=f"{self.steps:,} steps at batch {self.batch_size}, MFU {self.mfu:.0%}",
        )
        axis.grid(alpha=0.3, which="both")
        figure.tight_layout()
        return figure


def _mark_pareto(rows: list[PlanRow]) -> None:
    priced = [row for row in rows if row.cost is not None]
    for row in priced:
        row.pareto = not any(
            other.hours <= row.hours and other.cost <= row.cost and (other.hours < row.hours or other.cost < row.cost)
            for other in priced
        )


def _row(
    gpu: GPU, usable: int, needed: int, largest: int, price, precision: str, *, flops, traffic, kernels, mfu, steps
) -> PlanRow:
    """One GPU's row: does the step fit, the roofline step time and what bounds it, time and cost of the run."""
    peak = gpu.peak_tflops(precision)
    fits = needed <= usable
    step_time = bound = hours = cost = None
    if peak is not None:
        roofs = {
            "compute": flops / (peak * 1e12 * mfu),
            "memory": traffic / (gpu.bandwidth_tbs * 1e12),
            "launch": kernels * LAUNCH_SECONDS,
        }
        bound = max(roofs, key=roofs.get)
        step_time = roofs[bound]
    if fits and step_time is not None:
        hours = step_time * steps / 3600
        cost = hours * price if price is not None else None
    return PlanRow(gpu.name, gpu.memory_bytes, usable, needed, fits, largest, step_time, bound, hours, price, cost)
