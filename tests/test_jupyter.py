"""The pre-save hook `make lab` gives JupyterLab: a saved lesson keeps the language_info its file has."""

import json

import pytest

from gpukit.jupyter import keep_language_info

# JupyterLab's server comes with the dev extra; a GPU machine running only nbval may lack it.
FileContentsManager = pytest.importorskip("jupyter_server.services.contents.filemanager").FileContentsManager


@pytest.mark.parametrize("on_disk", [{"name": "python"}, None])
def test_save_hook_keeps_the_language_info_on_disk(tmp_path, on_disk):
    manager = FileContentsManager(root_dir=str(tmp_path))
    metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    if on_disk is not None:
        metadata["language_info"] = on_disk
    notebook = {"cells": [], "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "lesson.ipynb").write_text(json.dumps(notebook))
    from_lab = json.loads(json.dumps(notebook))
    from_lab["metadata"]["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    from_lab["cells"] = [{"cell_type": "markdown", "id": "a1", "metadata": {}, "source": "new"}]

    manager.pre_save_hook = keep_language_info
    manager.save({"type": "notebook", "format": "json", "content": from_lab}, "lesson.ipynb")
    saved = json.loads((tmp_path / "lesson.ipynb").read_text())
    assert "".join(saved["cells"][0]["source"]) == "new"  # the rest is saved as sent
    expected = on_disk if on_disk is not None else from_lab["metadata"]["language_info"]
    assert saved["metadata"]["language_info"] == expected
