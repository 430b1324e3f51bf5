"""Matplotlib figures for the lessons. Each function returns the Figure it drew (`compare` also
returns a table), a gpukit.figures.Figure: in a notebook it is shown exactly once, whether the cell ends
with the call, with the call and `;`, or with plt.show() (changes made to it before then included)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from . import runfile
from .report import Table

__all__ = [
    "Comparison",
    "compare",
    "plot_bars",
    "plot_curves",
    "plot_history",
    "plot_lr_find",
    "plot_lr_sensitivity",
    "plot_monitor",
    "plot_spread",
    "show_images",
]


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.5):
    from .figures import subplots

    figure, axes = subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return figure, list(axes[0])


def plot_history(history, title: str | None = None):
    """Loss per logged step; then, per epoch, accuracy (where it applies) or the epoch losses, and
    one panel for each of your metrics (train and held-out)."""
    names = history.metric_names
    panels = ["accuracy" if "train_accuracy" in names else "loss"]
    panels += [
        name[len("train_") :] for name in names if name.startswith("train_") and name[6:] not in ("loss", "accuracy")
    ]
    if any(row.get("energy_j") is not None for row in history.epochs):  # fit(monitor=True)
        panels.append("energy_j")
    timeline = bool(getattr(history, "monitor", None))
    figure, (loss_axis, *axes) = _figure(1 + len(panels) + timeline)
    if timeline:
        _draw_monitor(axes.pop(), history.monitor)
    loss_axis.plot([r["step"] for r in history.steps], [r["loss"] for r in history.steps])
    loss_axis.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    if history.steps and min(r["loss"] for r in history.steps) > 0:
        loss_axis.set_yscale("log")
    epochs = [r["epoch"] for r in history.epochs]
    for axis, panel in zip(axes, panels):
        for prefix, label in (("train_", "train"), ("eval_", "held-out")):
            values = [r.get(prefix + panel) for r in history.epochs]
            if any(value is not None for value in values):
                axis.plot(epochs, values, "o-", label=label)
        if panel == "energy_j":
            axis.bar(epochs, [r.get("energy_j") or 0.0 for r in history.epochs])
            axis.set(xlabel="epoch", ylabel="energy (J)", title="GPU energy per epoch")
            continue
        axis.set(xlabel="epoch", ylabel=panel, title=f"{panel} per epoch")
        if panel == "accuracy":
            axis.set_ylim(0, 1)
        axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


class Comparison(NamedTuple):
    """What `compare` returns: unpack it, `figure, table = gk.plots.compare(runs)`.

    Ending a cell with it shows the figure, once (as the call followed by `;` does); `display(table)` shows the
    table. (Showing the table too would make the two endings differ: nbval ignores a trailing `;`.)"""

    figure: Any  # a gpukit.figures.Figure
    table: Table

    def _ipython_display_(self) -> None:
        self.figure._ipython_display_()


def compare(histories, labels: Sequence[str] | None = None, metrics: Sequence[str] | None = None):
    """Several runs side by side: learning curves on shared axes, and a table of what they reached.

    histories: History objects (what fit returns), paths of saved ones (History.save), or a mix;
        or a dict {label: run}.
    labels: a name per run; default the saved file's name (runs/fp32.json → "fp32"), else "run 1", …
    metrics: per-epoch quantities drawn beside the loss, named without train_/eval_ (e.g.
        ["accuracy"], ["mae"]); default every one some run has. Training is dashed, held-out solid.
    Returns a Comparison (figure, table): the training loss per logged step and one panel per metric per
    epoch; a gk.Table with one row per run of its final values, throughput and wall time (History.summary()).
    """

    if isinstance(histories, Mapping):
        if labels is not None:
            raise ValueError("pass labels, or a dict {label: run}, not both.")
        labels, histories = list(histories), list(histories.values())
    if isinstance(histories, (str, os.PathLike)) or not isinstance(histories, Sequence) or not histories:
        raise ValueError(
            "compare takes a list of runs (History objects or paths of saved ones), or a dict {label: run}; "
            f"got {histories!r:.80}."
        )
    runs = [_as_run(item) for item in histories]
    if labels is None:
        labels = [name or f"run {index + 1}" for index, (name, *_) in enumerate(runs)]
        labels = [f"{label} ({index + 1})" if labels.count(label) > 1 else label for index, label in enumerate(labels)]
    elif isinstance(labels, str) or len(labels) != len(runs) or len(set(labels)) != len(labels):
        raise ValueError(f"labels must be {len(runs)} different names, one per run; got {labels!r}.")
    present = dict.fromkeys(
        column.split("_", 1)[1]
        for *_, epochs, _ in runs
        for row in epochs
        for column in row
        if column.startswith(("train_", "eval_"))
    )
    if metrics is None:
        metrics = list(present)
    else:
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        missing = [name for name in metrics if name not in present]
        if missing:
            raise ValueError(
                f"no run has {', '.join(map(repr, missing))} per epoch; these runs have {', '.join(present) or 'none'} "
                "(names without train_/eval_)."
            )
    figure, (loss_axis, *axes) = _figure(1 + len(metrics))
    for index, (label, (_, steps, epochs, _)) in enumerate(zip(labels, runs)):
        color = f"C{index}"
        loss_axis.plot([row["step"] for row in steps], [row["loss"] for row in steps], color=color, label=label)
        for axis, metric in zip(axes, metrics):
            for prefix, style in (("train_", "--"), ("eval_", "o-")):
                points = [
                    (row["epoch"], row[prefix + metric]) for row in epochs if row.get(prefix + metric) is not None
                ]
                if points:
                    axis.plot(
                        *zip(*points),
                        style,
                        color=color,
                        label=f"{label}, {'train' if prefix == 'train_' else 'held-out'}",
                    )
    loss_axis.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
    if all(row["loss"] > 0 for _, steps, _, _ in runs for row in steps):
        loss_axis.set_yscale("log")
    loss_axis.legend()
    for axis, metric in zip(axes, metrics):
        axis.set(xlabel="epoch", ylabel=metric, title=f"{metric} per epoch (dashed: train)")
        values = [y for line in axis.get_lines() for y in line.get_ydata()]
        if metric == "loss" and values and min(values) > 0:
            axis.set_yscale("log")  # losses of different runs can differ by orders of magnitude
        axis.legend(fontsize="small")
    figure.tight_layout()
    rows = [{"run": label} | summary for label, (*_, summary) in zip(labels, runs)]
    return Comparison(figure, Table(rows, title="final values, throughput and wall time (seconds)"))


def _as_run(item) -> tuple[str | None, list[dict], list[dict], dict]:
    """(name, steps, epochs, summary) of a History or of a file History.save wrote."""
    if isinstance(item, (str, os.PathLike)):
        record = runfile.read(item)
        name = os.path.splitext(os.path.basename(item))[0]
        return name, record["history"]["steps"], record["history"]["epochs"], record["summary"]
    if all(hasattr(item, name) for name in ("steps", "epochs", "summary")):
        return None, item.steps, item.epochs, item.summary()
    raise TypeError(f"compare takes History objects or paths of saved ones, got a {type(item).__name__}.")


def _draw_monitor(axis, samples: Sequence[dict]) -> None:
    """Power (W, left axis) and utilisation (%, right axis) over time from Monitor samples."""
    times = [row["t"] for row in samples]
    if any("power_w" in row for row in samples):
        axis.plot(times, [row.get("power_w") for row in samples], color="C3", label="power W")
    axis.set(xlabel="seconds", ylabel="power (W)", title="GPU over time")
    if any("utilization" in row for row in samples):
        right = axis.twinx()
        right.plot(times, [row.get("utilization") for row in samples], color="C0", alpha=0.6, label="utilisation %")
        right.set(ylabel="utilisation (%)", ylim=(0, 105))
    throttled = [row["t"] for row in samples if set(row.get("reasons", [])) - {"idle", "application clocks setting"}]
    for t in throttled:
        axis.axvline(t, color="orange", alpha=0.2, linewidth=1)


def plot_monitor(samples: Sequence[dict]):
    """A Monitor's timeline: power and utilisation; SM clock and temperature (orange: throttled)."""
    figure, (left, right) = _figure(2)
    _draw_monitor(left, samples)
    times = [row["t"] for row in samples]
    if any("sm_clock_mhz" in row for row in samples):
        right.plot(times, [row.get("sm_clock_mhz") for row in samples], color="C2", label="SM clock MHz")
    if any("temperature_c" in row for row in samples):
        right.plot(times, [row.get("temperature_c") for row in samples], color="C1", label="temperature °C")
    right.set(xlabel="seconds", title="clock and temperature")
    right.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_curves(
    curves: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
):
    """Several named (x, y) curves on one axis."""
    figure, (axis,) = _figure()
    for name, (x, y) in curves.items():
        axis.plot(x, y, "o-", label=name)
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        axis.set_xscale("log", base=2)
    if logy:
        axis.set_yscale("log")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def plot_bars(values: dict[str, float], *, ylabel: str, title: str = "", reference: float | None = None):
    """One bar per name; an optional dashed reference line (e.g. 1.0 for a ratio)."""
    figure, (axis,) = _figure(width=max(4.0, 0.9 * len(values) + 2))
    axis.bar(list(values), list(values.values()))
    if reference is not None:
        axis.axhline(reference, color="gray", linestyle="--", linewidth=1)
    axis.set(ylabel=ylabel, title=title)
    axis.tick_params(axis="x", rotation=20)
    figure.tight_layout()
    return figure


def show_images(images, labels, classes: Sequence[str], count: int = 16, mean=None, std=None):
    """A grid of images (uint8 (N, C, H, W), or normalised floats with mean/std) with their class names."""
    import math

    import torch

    images = images[:count].detach().cpu()
    if images.dtype != torch.uint8:
        images = images * torch.as_tensor(std)[:, None, None] + torch.as_tensor(mean)[:, None, None]
        images = (images.clamp(0, 1) * 255).to(torch.uint8)
    columns = min(8, len(images))
    rows = math.ceil(len(images) / columns)
    from .figures import subplots

    figure, axes = subplots(rows, columns, figsize=(1.3 * columns, 1.5 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, image, label in zip(axes.flat, images, labels[:count]):
        axis.imshow(image.permute(1, 2, 0).numpy())
        axis.set_title(classes[int(label)], fontsize=8)
    figure.tight_layout()
    return figure


def plot_lr_find(result, title: str = ""):
    """The lr range test (gk.lr_find): loss against lr (log scale), measured and smoothed, with the
    suggested lr and the lr where the smoothed loss leaves its lowest level marked."""
    import math

    figure, (axis,) = _figure(width=6.0)
    finite = [(lr, loss) for lr, loss in zip(result.lrs, result.losses) if math.isfinite(loss)]
    axis.plot([lr for lr, _ in finite], [loss for _, loss in finite], alpha=0.35, label="loss per step")
    axis.plot(result.lrs, result.smoothed, label="smoothed")
    # A sweep that ended before the loss rose marks its end, not a rise it never saw (gk.lr_find's `rose`).
    edge = "loss starts rising" if getattr(result, "rose", True) else "end of the sweep, no rise seen"
    axis.axvline(result.best_lr, color="gray", linestyle=":", linewidth=1, label=f"{edge} ({result.best_lr:.2g})")
    axis.axvline(result.suggestion, color="C3", linestyle="--", label=f"suggestion {result.suggestion:.2g}")
    low = min(result.smoothed)
    axis.set_ylim(top=max(low * 3, min(finite[0][1] * 1.5, max(loss for _, loss in finite))))
    axis.set(
        xscale="log", xlabel="learning rate", ylabel="training loss", title=title or f"lr range test: {result.rule}"
    )
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def plot_lr_sensitivity(
    results: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    ylabel: str = "final loss",
    title: str = "sensitivity to the learning rate",
):
    """One curve per optimizer: a final measure (loss) against the learning rate (log scale). A
    flat, wide valley means the optimizer forgives a poorly chosen lr."""
    figure, (axis,) = _figure(width=6.0)
    for name, (lrs, values) in results.items():
        axis.plot(lrs, values, "o-", label=name)
    axis.set(xscale="log", xlabel="peak learning rate", ylabel=ylabel, title=title)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def plot_spread(
    runs: dict[str, Sequence[tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logy: bool = False,
):
    """Curves of several seeds per name: the median as a line, the range over seeds as a band."""
    import numpy as np

    figure, (axis,) = _figure(width=6.0)
    for index, (name, curves) in enumerate(runs.items()):
        length = min(len(y) for _, y in curves)
        x = np.asarray(curves[0][0][:length])
        ys = np.asarray([y[:length] for _, y in curves])
        axis.plot(x, np.median(ys, axis=0), color=f"C{index}", label=f"{name} ({len(curves)} seeds)")
        axis.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=f"C{index}", alpha=0.2)
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        axis.set_yscale("log")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure
