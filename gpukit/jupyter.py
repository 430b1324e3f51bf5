"""JupyterLab settings for the lessons: opening and closing a lesson leaves its file unchanged.

JupyterLab writes the running kernel's `language_info` (with the exact Python version) into a notebook's
metadata as soon as the kernel starts, marks the notebook modified, and autosaves it: every learner's
`git status` would show the lessons changed before they ran a cell. `make lab` starts JupyterLab with
`keep_language_info` as the server's pre-save hook, which keeps the `language_info` the file already has.
"""

from __future__ import annotations


def keep_language_info(model: dict, path: str, contents_manager, **_) -> None:
    """Jupyter server pre-save hook: a notebook saved over an existing file keeps that file's language_info.

    Only that one metadata entry is kept; cells, outputs and every other field are saved as JupyterLab sends them.
    """
    if model.get("type") != "notebook" or not model.get("content") or not contents_manager.file_exists(path):
        return
    on_disk = contents_manager.get(path, content=True, type="notebook")["content"]
    language_info = on_disk.get("metadata", {}).get("language_info")
    if language_info is not None:
        model["content"]["metadata"]["language_info"] = language_info
