"""Live views for Jupyter: a progress bar (tqdm.auto) and an optional live loss plot.

In a terminal the bar is text and the live plot does nothing; when progress is off,
everything here does nothing.
"""

from __future__ import annotations

from .plots import plot_history


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets can be shown)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class LivePlot:
    """A loss curve redrawn in place in a notebook output area, every few updates."""

    def __init__(self, every: int = 5):
        import ipywidgets
        from IPython.display import display

        self.output = ipywidgets.Output()
        self.every = every
        self.calls = 0
        display(self.output)

    def update(self, history, force: bool = False) -> None:
        self.calls += 1
        if not force and self.calls % self.every:
            return
        import matplotlib.pyplot as plt
        from IPython.display import display

        with self.output:
            self.output.clear_output(wait=True)
            figure = plot_history(history)
            display(figure)
            plt.close(figure)


_SHORT = {"image": "img/s", "sequence": "seq/s", "sample": "samples/s"}


def throughput(row: dict, sample_name: str) -> dict[str, str]:
    """The throughput of a logged window for a progress bar: tokens/s for text, else samples/s."""
    if row.get("tokens_per_second") is not None:
        return {"tok_s": f"{row['tokens_per_second']:.0f}"}
    return {_SHORT.get(sample_name, "samples/s").replace("/", "_"): f"{row['samples_per_second']:.0f}"}


class Progress:
    """A tqdm.auto bar over optimizer steps, showing the latest loss and throughput."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, live_plot: bool = False):
        self.bar = None
        self.live = None
        self.history = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)
        if live_plot and in_notebook():
            self.live = LivePlot()

    def update(self, steps: int, row: dict, history) -> None:
        if self.bar is None:
            return
        self.bar.update(steps)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", **throughput(row, history.sample_name), refresh=False)
        self.history = history
        if self.live is not None:
            self.live.update(history)

    def epoch_done(self, history) -> None:
        if self.bar is None or not history.epochs:
            return
        shown = [name for name in history.metric_names if history.final(name) is not None]
        # Held-out figures when there are any; accuracy (or else the loss) first, then your metrics.
        shown = [name for name in shown if name.startswith("eval_")] or shown
        shown.sort(key=lambda name: (not name.endswith("accuracy"), not name.endswith("loss")))
        text = " ".join(f"{name} {history.final(name):.3g}" for name in shown[:3])
        if history.final("energy_j") is not None:  # fit(monitor=True)
            text += f" {history.final('energy_j'):.0f} J"
            if history.final("mean_power_w") is not None:
                text += f" {history.final('mean_power_w'):.0f} W"
        self.bar.set_description(f"epoch {history.epochs[-1]['epoch']} {text}")

    def close(self) -> None:
        if self.live is not None and self.history is not None and self.history.steps:
            self.live.update(self.history, force=True)  # the final curve stays in the output
        if self.bar is not None:
            self.bar.close()
            if getattr(self.bar, "container", None) is not None:  # a notebook widget, not a text bar
                # A saved notebook keeps only the widget's text form from when it was drawn ("0%"): GitHub,
                # nbval and a reader without the widget state would see a run that never started. This line
                # says what was done: steps, time, rate, last loss and the epoch's held-out figures.
                print(self.bar)
