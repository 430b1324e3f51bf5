"""Strict nbval (outputs compared) on a lesson, with the sanitize file gpukit ships (docs/nbval.md).

The lesson is executed once to record its outputs, then checked by strict nbval twice in a row:
green both times only because the sanitize file masks the figures that change between runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpukit as gk
from gpukit.commands import nbval
from gpukit.commands.cli import main

nbval_plugin = pytest.importorskip("nbval.plugin", reason="nbval is a dev extra: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient comes with jupyterlab: pip install -e '.[dev]'")
nbformat = pytest.importorskip("nbformat", reason="nbformat comes with nbval: pip install -e '.[dev]'")

REPO_ROOT = Path(__file__).resolve().parents[1]
LESSON = REPO_ROOT / "notebooks" / "00_environment_and_cpu_vs_gpu.ipynb"  # the fastest lesson
CELL_TIMEOUT = 120  # seconds per cell; a hang fails instead of stalling the suite


def sanitized(text: str) -> str:
    """`text` as strict nbval compares it: every rule of the sanitize file applied in order."""
    for regex, replace in nbval_plugin.get_sanitize_patterns(nbval.sanitize_path().read_text()):
        text = re.sub(regex, replace, text)
    return text


def test_the_command_and_the_function_give_the_shipped_file(capsys):
    assert main(["nbval-sanitize-path"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert (
        printed == nbval.sanitize_path()
        and printed.is_file()
        and printed.parent == Path(gk.__file__).parent / "commands"
    )
    assert len(nbval_plugin.get_sanitize_patterns(printed.read_text())) >= 10  # nbval reads its rules


def test_figures_are_masked_and_the_rest_is_kept():
    # Two runs of the same cell: timings differ (and so do the table's column widths).
    fast = gk.Table([{"model": "fast_cnn", "step (ms)": 22.14, "images/s": 2891.0, "peak": gk.format_bytes(3.2e6)}])
    slow = gk.Table([{"model": "fast_cnn", "step (ms)": 1105.3, "images/s": 57.9, "peak": gk.format_bytes(3.3e6)}])
    for first, second in ((str(fast), str(slow)), (fast._repr_html_(), slow._repr_html_())):
        assert first != second  # without the sanitize file strict nbval fails here
        assert sanitized(first) == sanitized(second), (sanitized(first), sanitized(second))
    lines = [
        (
            "100%|██████████| 40/40 [00:03<00:00, 12.5step/s, loss=1.23]",
            "100%|██████████| 40/40 [00:09<00:00, 4.1step/s, loss=1.19]",
        ),
        ("eval_accuracy=0.912 images_per_second=2031", "eval_accuracy=0.907 images_per_second=987"),
        ("peak 12.3 MiB in 950 ms, 97% of NVIDIA H100 80GB HBM3", "peak 512 B in 1.2 s, 8% of NVIDIA GeForce RTX 4090"),
        ("checkpoint in /tmp/tmpa1b2c3/last.pt", "checkpoint in /tmp/tmpz9y8x7/last.pt"),
    ]
    for first, second in lines:
        assert sanitized(first) == sanitized(second), (sanitized(first), sanitized(second))
    # What a lesson says is still compared: other rows, other words, a check that was skipped instead.
    other_model = gk.Table([{"model": "resnet18", "step (ms)": 22.14, "images/s": 2891.0, "peak": "3.1 MiB"}])
    assert sanitized(str(fast)) != sanitized(str(other_model))
    assert sanitized("check passed: bf16 beats fp32") != sanitized("skipped: bf16 needs a CUDA GPU")
    assert sanitized("Python 3.11.7, torch 2.14.1+cu130") == "Python 3.11.7, torch 2.14.1+cu130"  # versions kept


def strict_nbval(*notebooks: Path, cwd: Path, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Strict nbval (outputs compared, with gpukit's sanitize file) on `notebooks`, one after the other."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--nbval",
        "--nbval-current-env",
        f"--nbval-sanitize-with={nbval.sanitize_path()}",
        f"--nbval-cell-timeout={CELL_TIMEOUT}",
        "-p",
        "no:cacheprovider",
        "-q",
        "--rootdir",
        str(cwd),
        *options,
        *map(str, notebooks),
    ]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=os.environ.copy())


def record(notebook, path: Path):
    """Run `notebook` once in a fresh kernel of this Python, as `jupyter nbconvert --execute` does (cells kept in
    IPython's history), and write it with its outputs to `path`. Returns `path`."""
    from jupyter_client import KernelManager
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

    kernel = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # fills in the outputs
    nbformat.write(notebook, path)
    return path


@pytest.mark.slow
def test_a_lesson_passes_strict_nbval_twice_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")  # the kernels inherit this environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))

    # 1. Record: run the committed lesson once (as nbconvert --execute does) and keep its outputs.
    recorded = record(nbformat.read(LESSON, as_version=4), tmp_path / LESSON.name)

    # 2. Strict nbval twice in a row against the recording, both green; and, to show it is strict, a third copy
    # of the setup cell alone, whose recorded output differs in words (not in figures): that one fails.
    runs = [tmp_path / f"run_{run}" / LESSON.name for run in (1, 2)]
    for copy in runs:
        copy.parent.mkdir()
        shutil.copy(recorded, copy)
    tampered = tmp_path / "tampered" / LESSON.name
    tampered.parent.mkdir()
    setup_only = json.loads(recorded.read_text())
    first_code = next(index for index, cell in enumerate(setup_only["cells"]) if cell["cell_type"] == "code")
    setup_only["cells"] = setup_only["cells"][: first_code + 1]
    setup_only["cells"][first_code]["outputs"] = [
        {"output_type": "stream", "name": "stdout", "text": "a line no run prints\n"}
    ]
    tampered.write_text(json.dumps(setup_only))

    result = strict_nbval(*runs, tampered, cwd=tmp_path, options=("-rf",))
    code_cells = sum(cell["cell_type"] == "code" for cell in json.loads(recorded.read_text())["cells"])
    summary = re.search(r"(\d+) failed, (\d+) passed", result.stdout)
    assert summary, result.stdout[-6000:]
    assert (int(summary[1]), int(summary[2])) == (1, 2 * code_cells), result.stdout[-6000:]  # both runs green
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "tampered" in failed[0], failed


# Every way a cell can end with one of gpukit's plots (issue 31): the call, the call and `;`, plt.show() after it, a
# figure changed after the call, display() of a closed one; and plots from each module that draws one.
SETUP = """\
import matplotlib.pyplot as plt
import torch
from IPython.display import display
import gpukit as gk

timing = {"step_time": 0.1, "samples_per_second": 320.0}
first = gk.History(steps=[{"step": 1, "loss": 2.0} | timing, {"step": 2, "loss": 1.0} | timing],
                   epochs=[{"epoch": 1, "train_loss": 1.5, "train_accuracy": 0.4}])
second = gk.History(steps=[{"step": 1, "loss": 2.5} | timing, {"step": 2, "loss": 1.5} | timing],
                    epochs=[{"epoch": 1, "train_loss": 2.0, "train_accuracy": 0.3}])
images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
"""
PLOT_CELLS = {  # source: text that the one figure's text/plain must hold ("" for any)
    "first.plot()": "",
    "first.plot();": "",
    "first.plot()\nplt.show()": "",
    "figure = gk.plots.plot_bars({'a': 1.0, 'b': 2.0}, ylabel='x')\nfigure.set_size_inches(3, 2)\nplt.show()": "300x200",
    "figure = first.plot()\nplt.close(figure)\ndisplay(figure)": "",
    "gk.plots.show_images(images, [0, 1, 0, 1], ['circle', 'square'], count=4)": "",
    "gk.plots.show_images(images, [0, 1, 0, 1], ['circle', 'square'], count=4);": "",
    "gk.plots.compare([first, second])": "",
    "gk.plots.compare([first, second]);": "",
    "figure, table = gk.plots.compare([first, second])\nplt.show()": "",
    "gk.memory.plot_memory_timeline([1, 3, 2])": "",
    "gk.data.plot_sweep(gk.Table([{'num_workers': 0, 'prefetch_factor': None, 'samples_per_second': 9.0}]));": "",
}


def test_every_figure_gpukit_draws_is_a_figure_shown_once():
    """Each plotting function makes its figure with gpukit.figures.subplots (the Figure the notebook test below
    shows once), none with pyplot's own: a new plot elsewhere would bring back the double image."""
    made_by_pyplot = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in sorted((REPO_ROOT / "gpukit").rglob("*.py"))
        if path.name != "figures.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(plt|pyplot)\.(subplots|figure|subplot_mosaic)\(|\bFigure\(", line)
    ]
    assert not made_by_pyplot, made_by_pyplot
    history = gk.History(steps=[{"step": 1, "loss": 1.0, "step_time": 0.1, "samples_per_second": 9.0}])
    from gpukit.figures import Figure

    for figure in (history.plot(), gk.plots.compare([history, history]).figure, gk.memory.plot_memory_timeline([1])):
        assert isinstance(figure, Figure)
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.slow
def test_each_plot_is_shown_once_however_the_cell_ends_and_strict_nbval_agrees(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Jupyter
    sources = [SETUP, *PLOT_CELLS]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    recorded = record(notebook, tmp_path / "plots.ipynb")

    cells = nbformat.read(recorded, as_version=4).cells[1:]
    for cell, expected in zip(cells, PLOT_CELLS.values()):
        shown = [output for output in cell.outputs if "image/png" in output.get("data", {})]
        assert len(shown) == 1, (cell.source, [(o.output_type, list(o.get("data", o))) for o in cell.outputs])
        assert expected in shown[0]["data"]["text/plain"], (cell.source, shown[0]["data"]["text/plain"])
    # nbval runs cells outside IPython's history, where a trailing `;` hides nothing: the same outputs regardless.
    result = strict_nbval(recorded, cwd=tmp_path, options=("-rf",))
    assert result.returncode == 0 and f"{len(sources)} passed" in result.stdout, result.stdout[-6000:]


def documented_command() -> str:
    """The strict nbval command docs/nbval.md gives (its bash block's pytest line, continuation lines joined)."""
    block = re.search(r"```bash\n(.*?)```", (REPO_ROOT / "docs" / "nbval.md").read_text(), re.S)[1]
    return next(line for line in block.replace("\\\n", " ").splitlines() if " -m pytest " in line).strip()


@pytest.mark.slow
def test_the_documented_command_runs_with_your_projects_pytest_settings(tmp_path):
    """docs/nbval.md's command, run as written in a project of your own: pytest takes its rootdir and settings
    from your project, not from where gpukit is installed (a clone's pyproject.toml, with the kit's testpaths)."""
    command = documented_command()
    assert "my_notebook.ipynb" in command and "nbval-sanitize-path" in command, command
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "-p no:cacheprovider"\n')
    cell = nbformat.v4.new_code_cell("print('hello')", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]  # recorded
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), tmp_path / "my_notebook.ipynb")
    bin_folder = tmp_path / "bin"  # `python` in the command is this environment's
    bin_folder.mkdir()
    (bin_folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_folder / "python").chmod(0o755)
    environment = os.environ | {
        "PATH": f"{bin_folder}{os.pathsep}{os.environ['PATH']}",
        # gpukit from this checkout: its sanitize file lies inside a folder with gpukit's own pyproject.toml
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    assert (nbval.sanitize_path().parents[2] / "pyproject.toml").is_file()
    result = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=environment
    )
    assert f"rootdir: {tmp_path}\n" in result.stdout, result.stdout[-3000:]  # space form: rootdir was the kit's
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-3000:]
