"""JupyterLab settings for the lessons: opening and closing a lesson leaves its file unchanged.

JupyterLab writes the running kernel's `language_info` (with the exact Python version) into a notebook's
metadata as soon as the kernel starts, marks the notebook modified, and autosaves it: every learner's
`git status` would show the lessons changed before they ran a cell. `make lab` starts JupyterLab with
`keep_language_info` as the server's pre-save hook, which keeps the `language_info` the file already has.
"""

from __future__ import annotations

import json
from pathlib import Path


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
