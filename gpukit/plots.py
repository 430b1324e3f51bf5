"""Matplotlib figures for the lessons. Each function returns the Figure it drew."""

from __future__ import annotations

from collections.abc import Sequence


def _figure(ncols: int = 1, width: float = 5.0, height: float = 3.5):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
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
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(rows, columns, figsize=(1.3 * columns, 1.5 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, image, label in zip(axes.flat, images, labels[:count]):
        axis.imshow(image.permute(1, 2, 0).numpy())
        axis.set_title(classes[int(label)], fontsize=8)
    figure.tight_layout()
    return figure
