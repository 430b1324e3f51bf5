"""gpukit from a pip install: the wheel ships the lessons and the cluster examples, and lessons run from any folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from gpukit import shipped
from gpukit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_and_maps_the_shipped_folders():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "gpukit").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"gpukit.lessons", "gpukit.cluster"}
    for name, folder in shipped.IN_A_CLONE.items():
        assert setuptools["package-dir"][f"gpukit.{name}"] == folder
        assert shipped.folder(name) == ROOT / folder


def test_copy_lessons_copies_every_lesson_and_never_overwrites_without_force(tmp_path, capsys):
    assert main(["lessons", str(tmp_path / "mine")]) == 0
    copied = sorted(path.name for path in (tmp_path / "mine").iterdir())
    assert copied == sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb")) and len(copied) >= 10
    assert f"copied {len(copied)} lessons" in capsys.readouterr().out

    edited = tmp_path / "mine" / copied[0]
    edited.write_text("my edits")
    assert main(["lessons", str(tmp_path / "mine")]) == 2
    error = capsys.readouterr().err
    assert copied[0] in error and "--force" in error
    assert edited.read_text() == "my edits"  # refused: nothing replaced
    assert main(["lessons", str(tmp_path / "mine"), "--force"]) == 0
    assert edited.read_bytes() == (ROOT / "notebooks" / copied[0]).read_bytes()


def test_folder_names_what_it_ships():
    with pytest.raises(ValueError, match="'lessons', 'cluster'"):
        shipped.folder("data")


def _fresh_venv_with_the_wheel(tmp_path: Path) -> Path:
    """A venv holding gpukit only as installed from its wheel; its dependencies come from this interpreter's
    site-packages, added by a .pth line (which, unlike a site folder, runs none of that folder's own .pth files,
    so the editable install of the clone stays out of sight)."""
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the clone
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", ".whl", "*.egg-info", "build", "dist"))
    quiet = {"check": True, "capture_output": True, "text": True, "timeout": 300}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        **quiet,
    )
    [wheel] = (tmp_path / "dist").glob("gpukit-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **quiet)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], **quiet).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        **quiet,
    )
    return python


@pytest.mark.slow
def test_lessons_run_from_a_wheel_in_a_folder_of_their_own(tmp_path):
    python = _fresh_venv_with_the_wheel(tmp_path)
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    found = subprocess.run(
        [python, "-c", "import gpukit; print(gpukit.__file__)"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert Path(found).is_relative_to(tmp_path / "venv"), found  # the wheel's gpukit, not the clone's
    lessons = tmp_path / "my lessons"
    subprocess.run([python, "-m", "gpukit", "lessons", str(lessons)], env=environment, check=True, timeout=60)
    run = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "--nbval-lax",
            "--nbval-current-env",
            "-p",
            "no:cacheprovider",
            "-q",
            "00_environment_and_cpu_vs_gpu.ipynb",
            "05_beyond_one_machine.ipynb",
        ],
        cwd=lessons,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
    assert (
        sorted(path.name for path in lessons.iterdir() if not path.name.endswith(".ipynb")) == []
    )  # wrote nothing beside
