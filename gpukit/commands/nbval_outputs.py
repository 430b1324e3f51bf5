"""A pytest plugin that keeps the notebooks nbval executed, with their outputs, for the lessons' site.

    pytest -p gpukit.commands.nbval_outputs --nbval-lax --nbval-keep-outputs DIR notebooks/

nbval runs each cell and compares or discards its outputs; with this plugin each notebook is also written to
DIR/<name>.ipynb after every cell, with the outputs nbval received (an error's traceback included) and execution
counts in the order the cells ran, so that a lesson stopped part-way still shows how far it got. `make gpu-check`
runs the lessons so (runs/gpu-check/DATE-TIME/notebooks/), and `gpukit site DIR --from THAT` publishes them
(gpukit/site.py). It reads nbval's own items (`cell`, `test_outputs`, the file's `nb`): nbval 0.11.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import nbformat

METADATA_KEY = "gpukit"  # the same key gpukit/site.py reads: {"executed": ISO time, "seconds": …}


def pytest_addoption(parser) -> None:
    parser.getgroup("nbval").addoption(
        "--nbval-keep-outputs",
        metavar="DIR",
        help="write each notebook nbval runs to DIR/<name>.ipynb with its outputs (gpukit.commands.nbval_outputs)",
    )


def _kept(item):
    """(the folder to write to, nbval's notebook) for an nbval cell when --nbval-keep-outputs is given, else None."""
    folder = item.config.getoption("nbval_keep_outputs", None)
    notebook = getattr(item.parent, "nb", None)
    return (Path(folder), notebook) if folder and notebook is not None and hasattr(item, "test_outputs") else None


def pytest_runtest_setup(item) -> None:
    kept = _kept(item)
    if kept and "started" not in kept[1].metadata.get(METADATA_KEY, {}):  # the lesson's first cell
        now = datetime.datetime.now().isoformat(timespec="seconds")
        kept[1].metadata[METADATA_KEY] = {"executed": now, "started": time.monotonic(), "count": 0}


def pytest_runtest_teardown(item, nextitem) -> None:
    kept = _kept(item)
    if not kept or item.test_outputs is None:  # None: nbval skipped the cell before running it
        return
    folder, notebook = kept
    ran = notebook.metadata[METADATA_KEY]
    ran["count"] += 1
    item.cell.outputs = list(item.test_outputs)
    item.cell.execution_count = ran["count"]
    copy = nbformat.from_dict(notebook)  # nbval's own notebook keeps the bookkeeping above
    copy.metadata[METADATA_KEY] = {"executed": ran["executed"], "seconds": round(time.monotonic() - ran["started"], 1)}
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(copy, folder / Path(str(item.parent.fspath)).name)
