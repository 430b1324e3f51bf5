"""The Figure every gpukit plot returns: in a notebook it appears exactly once, however the cell ends.

A plain matplotlib Figure that a function returns appears twice when a cell ends with the call: once as the
cell's value, and once more when the inline backend shows every open figure at the end of the cell. A trailing
`;` hides the first only where IPython keeps the cell in its history, and nbval runs cells outside it: a
notebook recorded with `history.plot();` (one image) failed strict nbval (two images, "dissimilar number of
outputs"). This Figure is drawn into the output the first time anything shows it (the cell's value, display(),
the inline backend at the end of the cell, plt.show()) and then closed, so that nothing shows it again.

Nothing changes outside a notebook with an inline backend: a script, a terminal or a window backend (Qt,
ipympl) gets matplotlib's own behaviour, since no image formatter is registered there.

Imported on first use (by the plotting functions), so that `import gpukit` does not load matplotlib.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure as MatplotlibFigure

__all__ = ["Figure", "subplots"]


class Figure(MatplotlibFigure):
    """A matplotlib Figure that a notebook shows once: at the end of the cell, at plt.show() or at display().

    Changes made to it after the plotting call (`figure.axes[0].set_yscale("log")`) are in what is shown, as
    long as it is shown later in the cell (by plt.show() or the cell's end).
    """

    def _ipython_display_(self) -> None:
        from IPython import get_ipython
        from IPython.display import publish_display_data

        shell = get_ipython()
        if shell is None:
            return
        formats = shell.display_formatter
        data, metadata = {}, {}
        for mime, formatter in formats.formatters.items():
            if mime not in formats.active_types:
                continue
            value = formatter(self)  # what IPython would send for a plain Figure; some give (data, metadata)
            value, extra = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            if value is not None:
                data[mime] = value
            if extra is not None:
                metadata[mime] = extra
        if data:
            publish_display_data(data, metadata=metadata)
        if set(data) - {"text/plain"}:
            # Drawn into the output: the inline backend would draw it again at the end of the cell. Without an
            # image (a window backend, Agg) the figure stays open for the backend to show, as matplotlib's does.
            plt.close(self)


def subplots(rows: int = 1, columns: int = 1, **options):
    """plt.subplots(rows, columns, **options) making a gpukit Figure (shown once in a notebook)."""
    return plt.subplots(rows, columns, FigureClass=Figure, **options)
