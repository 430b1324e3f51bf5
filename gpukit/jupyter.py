"""JupyterLab for the lessons: `gpukit lab DIR` (and `make lab`) start it, and opening and closing a lesson leaves
its file unchanged.

JupyterLab writes the running kernel's `language_info` (with the exact Python version) into a notebook's
metadata as soon as the kernel starts, marks the notebook modified, and autosaves it: every learner's
`git status` would show the lessons changed before they ran a cell. `make lab` starts JupyterLab with
`keep_language_info` as the server's pre-save hook, which keeps the `language_info` the file already has.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The server option that makes JupyterLab save lessons with the language_info they have (keep_language_info, below).
KEEP_LANGUAGE_INFO = "--FileContentsManager.pre_save_hook=gpukit.jupyter.keep_language_info"


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(folder: str | Path, options: list[str] = (), as_root: bool | None = None) -> list[str]:
    """The command that opens `folder` in JupyterLab with this Python: gpukit's save hook, then `options` (yours:
    --port, --ip, --no-browser, …, which come last and so win).

    JupyterLab refuses to start as root (a container, a cloud machine's default user) unless told `--allow-root`;
    as root it is added here, since the alternative is no JupyterLab at all.
    """
    as_root = running_as_root() if as_root is None else as_root
    return [
        sys.executable,
        "-m",
        "jupyterlab",
        KEEP_LANGUAGE_INFO,
        *(["--allow-root"] if as_root else []),
        *options,
        str(folder),
    ]


def keep_language_info(model: dict, path: str, contents_manager, **_) -> None:
    """Jupyter server pre-save hook: a notebook saved over an existing file keeps that file's language_info.

    Only that one metadata entry is kept; cells, outputs and every other field are saved as JupyterLab sends
    them. (The server's contents managers are asynchronous, so the file is read here directly.)
    """
    if model.get("type") != "notebook" or not model.get("content"):
        return
    try:
        on_disk = json.loads((Path(contents_manager.root_dir) / path.strip("/")).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a new notebook, or a file that is not JSON: nothing to keep
        return
    language_info = on_disk.get("metadata", {}).get("language_info") if isinstance(on_disk, dict) else None
    if language_info is not None:
        model["content"]["metadata"]["language_info"] = language_info
