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
from gpukit import nbval
from gpukit.cli import main

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
    assert printed == nbval.sanitize_path() and printed.is_file() and printed.parent == Path(gk.__file__).parent
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
        "--nbval-sanitize-with",
        str(nbval.sanitize_path()),
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


@pytest.mark.slow
def test_a_lesson_passes_strict_nbval_twice_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")  # the kernels inherit this environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    from jupyter_client import KernelManager
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

    # 1. Record: run the committed lesson once (as nbconvert --execute does) and keep its outputs.
    recorded = tmp_path / LESSON.name
    notebook = nbformat.read(LESSON, as_version=4)
    kernel = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    client = nbclient.NotebookClient(
        notebook, km=kernel, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # fills in the outputs
    nbformat.write(notebook, recorded)

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
