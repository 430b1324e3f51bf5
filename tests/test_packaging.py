"""gpukit from a pip install: the wheel ships the lessons and the cluster examples, and lessons run from any folder."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from unittest import mock

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from gpukit import shipped
from gpukit.cli import main

markdown2html_mistune = pytest.importorskip("nbconvert.filters.markdown_mistune").markdown2html_mistune

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """gpukit's wheel, built from a copy of the clone (so that the build leaves nothing in it)."""
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", ".whl", "*.egg-info", "build", "dist"))
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
            str(folder),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [built] = folder.glob("gpukit-*.whl")
    return built


def _venv(folder: Path) -> tuple[Path, Path]:
    """A fresh venv without pip: its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return python, Path(
        subprocess.run([python, "-c", where], capture_output=True, text=True, check=True).stdout.strip()
    )


@pytest.mark.slow
def test_lessons_run_from_a_wheel_in_a_folder_of_their_own(tmp_path, wheel):
    # gpukit only from its wheel; the dependencies from this interpreter's site-packages, added by a .pth line
    # (which, unlike a site folder, runs none of that folder's own .pth files: the clone's editable install stays out).
    python, site = _venv(tmp_path / "venv")
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--target",
        str(site),
        str(wheel),
    ]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
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
    assert [path.name for path in lessons.iterdir() if path.suffix != ".ipynb"] == []  # wrote nothing beside them


def _install_command_of_the_first_cell(lesson: Path) -> list[str]:
    """What the lesson's install cell runs where gpukit is missing (Colab, Kaggle): its pip arguments."""
    import importlib.util

    cell = next(cell for cell in json.loads(lesson.read_text())["cells"] if cell["cell_type"] == "code")
    commands = []
    real_find_spec = importlib.util.find_spec
    with (
        mock.patch("importlib.util.find_spec", lambda name: None if name == "gpukit" else real_find_spec(name)),
        mock.patch("subprocess.run", lambda command, **_: commands.append(command)),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        exec("".join(cell["source"]), {})
    [command] = commands
    return command[command.index("install") + 1 :]


def _runtime_with(site: Path, torch_version: str) -> None:
    """Make `site` look like a Colab image: every dependency of gpukit installed, torch at `torch_version`."""
    installed = {
        "torch": torch_version,
        "torchvision": "0.26.0",
        "numpy": "2.1.0",
        "matplotlib": "3.9.0",
        "ipywidgets": "8.1.0",
        "tqdm": "4.66.0",
        "cloudpickle": "3.0.0",
    }
    for name, version in installed.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("")


@pytest.mark.slow
@pytest.mark.parametrize("torch_version", ["2.11.0", "2.10.0"])
def test_the_install_cell_keeps_the_runtimes_torch(tmp_path, wheel, torch_version):
    """Colab's torch stays: 2.11 (supported) is kept and only gpukit is installed; 2.10 (too old) stops pip with a
    conflict rather than pulling a new torch."""
    arguments = _install_command_of_the_first_cell(ROOT / "notebooks" / "01_train_a_cnn.ipynb")
    spec = next(argument for argument in arguments if argument.startswith("gpukit @ git+"))
    python, site = _venv(tmp_path / "runtime")
    _runtime_with(site, torch_version)
    # The cell pins what is installed here (this interpreter's torch); the runtime's versions replace them.
    pins = [f"torch=={torch_version}", "torchvision==0.26.0"]
    assert [argument.split("==")[0] for argument in arguments if "==" in argument] == ["torch", "torchvision"]
    report = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--dry-run",
        "--report",
        str(report),
        "--no-index",
        "--find-links",
        str(wheel.parent),
        "gpukit",
        *pins,
    ]
    assert spec.endswith(_repository()) and "-q" in arguments
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if torch_version == "2.11.0":
        assert result.returncode == 0, result.stderr
        assert [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]] == ["gpukit"]
    else:
        assert result.returncode != 0 and "conflict" in result.stderr.lower(), result.stderr
        assert not report.exists()


def _repository() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"].rstrip("/")


def test_badges_and_install_cells_are_built_from_the_one_repository_url():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import open_in
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert open_in.main(check=True) == 0, "run python tools/open_in.py"
    repo = _repository().removeprefix("https://github.com/")
    readme = (ROOT / "README.md").read_text()
    assert set(re.findall(r"git\+(https://github\.com/[\w.-]+/[\w.-]+)", readme)) == {_repository()}  # pip install line
    for lesson in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(lesson.read_text())["cells"]
        title = "".join(cells[0]["source"])
        target = f"{repo}/blob/main/notebooks/{lesson.name}"
        for text in (title, readme):
            assert f"https://colab.research.google.com/github/{target})" in text, lesson.name
            assert f"https://kaggle.com/kernels/welcome?src=https://github.com/{target})" in text, lesson.name
        # Rendered as Jupyter renders markdown: links around badge images, not text (nbconvert's mistune).
        html = markdown2html_mistune(title)
        assert f'<a href="https://colab.research.google.com/github/{target}"><img' in html, lesson.name
        assert cells[1]["id"] == "install-gpukit" and f"git+https://github.com/{repo}" in "".join(cells[1]["source"])
