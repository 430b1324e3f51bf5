"""JupyterLab as `gpukit lab` (and `make lab`) runs it: a lesson opened is not marked modified, a lesson saved keeps
its file's metadata, and a lesson run and saved leaves `git status` clean where nbstripout strips its outputs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.jupyter import keep_file_metadata

# JupyterLab's server comes with the lab extra; a GPU machine running only nbval may lack it.
pytest.importorskip("jupyter_server")
from jupyter_client import KernelManager  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_server.services.contents.filemanager import FileContentsManager  # noqa: E402
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager  # noqa: E402
from traitlets.config import Configurable  # noqa: E402

from gpukit.lab_contents import LessonContentsManager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "notebooks" / "05_beyond_one_machine.ipynb"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


@pytest.mark.parametrize("on_disk", [{"name": "python"}, None])
def test_save_hook_keeps_the_language_info_and_kernelspec_on_disk(tmp_path, on_disk):
    manager = FileContentsManager(root_dir=str(tmp_path))
    metadata = {"kernelspec": dict(KERNELSPEC)}
    if on_disk is not None:
        metadata["language_info"] = on_disk
    notebook = {"cells": [], "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "lesson.ipynb").write_text(json.dumps(notebook))
    from_lab = json.loads(json.dumps(notebook))
    from_lab["metadata"]["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    from_lab["metadata"]["kernelspec"]["display_name"] = "Python 3 (ipykernel)"  # the pip route's kernel
    from_lab["cells"] = [{"cell_type": "markdown", "id": "a1", "metadata": {}, "source": "new"}]

    manager.pre_save_hook = keep_file_metadata
    manager.save({"type": "notebook", "format": "json", "content": from_lab}, "lesson.ipynb")
    saved = json.loads((tmp_path / "lesson.ipynb").read_text())
    assert "".join(saved["cells"][0]["source"]) == "new"  # the rest is saved as sent
    expected = on_disk if on_disk is not None else from_lab["metadata"]["language_info"]
    assert saved["metadata"]["language_info"] == expected
    assert saved["metadata"]["kernelspec"] == KERNELSPEC


class Server(Configurable):
    """What the contents manager asks of Jupyter's server: its kernel specs."""

    kernel_spec_manager = None


def contents(root: Path, manager_class=LessonContentsManager):
    server = Server()
    server.kernel_spec_manager = KernelSpecManager()
    return manager_class(root_dir=str(root), parent=server)


def kernel_reports(name: str) -> tuple[dict, dict]:
    """(kernelspec, language_info) as JupyterLab writes them once the kernel `name` of this machine has started."""
    kernel = KernelManager(kernel_name=name)
    kernel.start_kernel()
    try:
        client = kernel.client()
        client.start_channels()
        reply = client.kernel_info(reply=True, timeout=120)["content"]
        client.stop_channels()
    finally:
        kernel.shutdown_kernel(now=True)
    spec = KernelSpecManager().get_kernel_spec(name)
    return {"name": name, "display_name": spec.display_name, "language": spec.language}, reply["language_info"]


@pytest.mark.timeout(180)
def test_a_lesson_opens_with_the_metadata_its_kernel_will_report(tmp_path):
    """JupyterLab marks a notebook modified when the kernel's kernelspec or language_info differ (deeply) from the
    notebook's: the lesson must open holding exactly what this machine's kernel reports."""
    shutil.copy(LESSON, tmp_path / LESSON.name)
    served = asyncio.run(contents(tmp_path).get(LESSON.name))["content"]["metadata"]
    kernelspec, language_info = kernel_reports(served["kernelspec"]["name"])
    assert served["language_info"] == language_info
    assert served["kernelspec"] == kernelspec
    plain = asyncio.run(contents(tmp_path, AsyncLargeFileManager).get(LESSON.name))["content"]["metadata"]
    assert plain["language_info"] != language_info  # what JupyterLab opened before: marked modified at once
    assert json.loads((tmp_path / LESSON.name).read_text()) == json.loads(LESSON.read_text())  # the file untouched


def git(folder: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


@pytest.fixture
def clone(tmp_path):
    """A git repository holding one lesson, with the output-stripping filter `make setup` installs."""
    if shutil.which("git") is None or shutil.which("nbstripout", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("needs git and nbstripout (the dev extra)")
    git(tmp_path, "init", "-q")
    subprocess.run([sys.executable, "-m", "nbstripout", "--install"], cwd=tmp_path, check=True, timeout=60)
    git(tmp_path, "config", "filter.nbstripout.clean", f"'{sys.executable}' -m nbstripout --keep-id")
    shutil.copy(LESSON, tmp_path / LESSON.name)
    git(tmp_path, "add", LESSON.name)
    git(tmp_path, "-c", "user.name=gpukit", "-c", "user.email=gpukit@example.com", "commit", "-qm", "lesson")
    return tmp_path


def save_as_run(manager, edit: str | None = None) -> None:
    """Save the lesson as JupyterLab does after running it: outputs, execution counts, this kernel's metadata."""
    model = asyncio.run(manager.get(LESSON.name))
    notebook = model["content"]
    for count, cell in enumerate([cell for cell in notebook["cells"] if cell["cell_type"] == "code"], start=1):
        cell["execution_count"] = count
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"ran {count}\n"}]
        if edit is not None and count == 1:
            cell["source"] = edit
    notebook["metadata"]["language_info"] = {"name": "python", "version": "3.11.7"}
    asyncio.run(manager.save({"type": "notebook", "format": "json", "content": notebook}, LESSON.name))


@pytest.mark.timeout(120)
def test_a_lesson_run_and_saved_leaves_git_status_clean(clone):
    """git calls a file whose size changed modified without running the clean filter (`git diff`, which runs it,
    shows nothing): after JupyterLab's plain save, `git status` lists the lesson; after gpukit's, it does not."""
    before = contents(clone, AsyncLargeFileManager)
    before.pre_save_hook = keep_file_metadata  # what `gpukit lab` gave JupyterLab before: the metadata kept
    save_as_run(before)
    assert (
        git(clone, "status", "--porcelain", "--untracked-files=no") == f" M {LESSON.name}\n"
        and git(clone, "diff") == ""
    )  # the bug
    git(clone, "checkout", "--", LESSON.name)
    save_as_run(contents(clone))
    assert "ran 1" in (clone / LESSON.name).read_text()  # the outputs are in the file, for the learner
    assert git(clone, "status", "--porcelain", "--untracked-files=no") == "" and git(clone, "diff") == ""


@pytest.mark.timeout(120)
def test_a_real_edit_still_shows_and_nothing_is_staged(clone):
    save_as_run(contents(clone), edit="print('my change')")
    assert git(clone, "status", "--porcelain", "--untracked-files=no") == f" M {LESSON.name}\n"
    assert "my change" in git(clone, "diff") and git(clone, "diff", "--cached") == ""
