"""JupyterLab for the lessons: `gpukit lab DIR` (and `make lab`) start it; opening a lesson does not mark it modified,
and running one leaves `git status` clean where the clone strips outputs (make setup's nbstripout filter).

Two things made a lesson look changed when it was not:
- JupyterLab writes the running kernel's `kernelspec` and `language_info` (with the exact Python version) into a
  notebook's metadata as soon as the kernel starts. It compares them deeply first, but a committed lesson cannot
  hold every learner's Python version: the notebook was marked modified on opening, asked to be saved on closing,
  and autosaved. `gpukit lab` serves each notebook with the metadata its kernel will report (`as_the_kernel_reports`,
  in gpukit/lab_contents.py) and saves it with the metadata its file had (`keep_file_metadata`).
- git's index records each file's size; where a clean filter (nbstripout) is set, `git status` calls a file whose
  size changed modified without running the filter, while `git diff` runs it and shows nothing. A lesson saved
  with its outputs always changes size. After each save of a tracked notebook, `forget_git_stat` tells git's index
  that it no longer knows the file's size (the index's own entry, kept otherwise as it was), so that the next `git
  status` runs the filter and compares what is really there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The server option that gives JupyterLab gpukit's contents manager (gpukit/lab_contents.py): the two fixes above.
CONTENTS_MANAGER = "--ServerApp.contents_manager_class=gpukit.lab_contents.LessonContentsManager"


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(folder: str | Path, options: list[str] = (), as_root: bool | None = None) -> list[str]:
    """The command that opens `folder` in JupyterLab with this Python: gpukit's contents manager, then `options`
    (yours: --port, --ip, --no-browser, …, which come last and so win).

    JupyterLab refuses to start as root (a container, a cloud machine's default user) unless told `--allow-root`;
    as root it is added here, since the alternative is no JupyterLab at all.
    """
    as_root = running_as_root() if as_root is None else as_root
    return [
        sys.executable,
        "-m",
        "jupyterlab",
        CONTENTS_MANAGER,
        *(["--allow-root"] if as_root else []),
        *options,
        str(folder),
    ]


def python_language_info() -> dict:
    """What ipykernel in this Python reports as its language_info (the Python version included)."""
    from ipykernel.ipkernel import IPythonKernel  # JupyterLab's server has ipykernel (the lab extra): loaded there

    return json.loads(json.dumps(IPythonKernel.language_info))


def as_the_kernel_reports(metadata: dict, kernel_spec: dict | None, language_info: dict) -> None:
    """Give a notebook's metadata, as it is opened, what JupyterLab writes into it once its kernel starts.

    kernel_spec: the spec of the kernel the notebook names (its display_name and language), None where none is
    installed. language_info: what that kernel will report; used for Python notebooks only.
    """
    named = metadata.get("kernelspec") or {}
    if kernel_spec is not None and named.get("name"):
        # JupyterLab writes exactly these three (its NotebookPanel._updateSpec).
        language = kernel_spec.get("language") or named.get("language")
        metadata["kernelspec"] = {
            "name": named["name"],
            "display_name": kernel_spec.get("display_name"),
            "language": language,
        }
    python = (metadata.get("kernelspec") or {}).get("language", "python") == "python"
    if python and (metadata.get("language_info") or {}).get("name", "python") == "python":
        metadata["language_info"] = language_info


def keep_file_metadata(model: dict, path: str, contents_manager, **_) -> None:
    """Jupyter server pre-save hook: a notebook saved over an existing file keeps that file's language_info, and its
    kernelspec where the kernel is still the one the file names.

    Only those metadata entries are kept; cells, outputs and every other field are saved as JupyterLab sends them.
    (The server's contents managers are asynchronous, so the file is read here directly.)
    """
    if model.get("type") != "notebook" or not model.get("content"):
        return
    try:
        on_disk = json.loads((Path(contents_manager.root_dir) / path.strip("/")).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a new notebook, or a file that is not JSON: nothing to keep
        return
    kept = on_disk.get("metadata", {}) if isinstance(on_disk, dict) else {}
    metadata = model["content"]["metadata"]
    if kept.get("language_info") is not None:
        metadata["language_info"] = kept["language_info"]
    if (kept.get("kernelspec") or {}).get("name") == (metadata.get("kernelspec") or {}).get("name") is not None:
        metadata["kernelspec"] = kept["kernelspec"]


# The previous name of the pre-save hook (a server started with the old option still finds it).
keep_language_info = keep_file_metadata


def forget_git_stat(os_path: str, **_) -> None:
    """Jupyter server post-save hook: where the saved file is tracked by git, its index entry keeps its content (the
    same blob, mode and path) but forgets the file's size and times (`git update-index --cacheinfo`), so that the
    next `git status` compares the file through the clean filter instead of calling it modified for its new size.

    A real change still shows (git status and git diff agree); nothing is staged. Outside a git clone, for a file
    git does not track, or in a merge (several stages), it does nothing.
    """
    folder, name = os.path.split(os_path)

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=folder or ".", capture_output=True, text=True, timeout=30)

    try:
        entries = git("ls-files", "--stage", "--", name).stdout.splitlines()  # "100644 <blob> 0\tname"
        if len(entries) != 1:
            return
        mode, blob, stage = entries[0].split("\t")[0].split()
        if stage == "0":
            git("update-index", "--cacheinfo", f"{mode},{blob},{name}")
    except (OSError, subprocess.TimeoutExpired, ValueError):  # no git here, or a git that hangs: the save stands
        return
