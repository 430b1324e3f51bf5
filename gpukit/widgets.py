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


def throughput(history) -> dict[str, str]:
    """The bar's rate, named: History's own so far (the median over the logged windows after the first, the figure
    `history.samples_per_second` or `history.tokens_per_second` gives once fit returns), in tokens/s for text, else
    in the samples' unit. One window alone swings with the machine's load; the median is the figure History keeps."""
    if history.tokens_per_second is not None:
        return {"median tok/s": f"{history.tokens_per_second:.0f}"}
    return {f"median {_SHORT.get(history.sample_name, 'samples/s')}": f"{history.samples_per_second:.0f}"}


def _is_widget_bar(bar_class) -> bool:
    """True where tqdm.auto chose its Jupyter widget (a kernel with ipywidgets), not its text bar."""
    from tqdm.notebook import tqdm_notebook

    return isinstance(bar_class, type) and issubclass(bar_class, tqdm_notebook)


class Progress:
    """A tqdm.auto bar over optimizer steps, showing the latest loss and History's throughput.

    In Jupyter the bar is a widget while training runs and, when it ends, that same output becomes the bar's final
    text line (steps, time, rate, loss, the epoch's held-out figures): one bar on the screen, and a saved notebook,
    GitHub, nbval or the lessons' site show what was done rather than the widget's first frame ("0%").
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, live_plot: bool = False):
        self.bar = None
        self.live = None
        self.history = None
        self.shown = None  # the widget's output in the notebook (IPython's DisplayHandle), to replace at the end
        if not enabled:
            return
        from tqdm.auto import tqdm

        options = dict(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)
        if _is_widget_bar(tqdm):
            from IPython.display import display

            self.bar = tqdm(**options, display=False)
            self.shown = display(self.bar.container, display_id=True)  # None outside a kernel: printed instead
        else:
            self.bar = tqdm(**options)
        if live_plot and in_notebook():
            self.live = LivePlot()

    def update(self, steps: int, row: dict, history) -> None:
        if self.bar is None:
            return
        self.bar.update(steps)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", **throughput(history), refresh=False)
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
        if self.bar is None:
            return
        self.bar.close()
        container = getattr(self.bar, "container", None)
        if container is None:  # a terminal's text bar already shows its final state (on stderr)
            return
        if self.shown is not None:
            self.shown.update({"text/plain": str(self.bar)}, raw=True)  # the widget's output, now its final line
            container.close()  # the widget's model in the kernel, no longer shown
        else:
            print(self.bar)
