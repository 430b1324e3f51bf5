"""gpukit from a pip install: the wheel ships the lessons and the cluster examples, and lessons run from any folder."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from gpukit import shipped
from gpukit.cli import main
from tests import lessons_env

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


def _lessons_kernel(folder: Path, wheel: Path) -> tuple[Path, dict[str, str]]:
    """A Python with the wheel's gpukit and exactly what gpukit[lessons] brings (tests/lessons_env.py), and the
    environment variables under which nbval's `--nbval-kernel-name gpukit-lessons` runs lessons in it."""
    python = lessons_env.build(folder, gpukit_from=None)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site, str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment["JUPYTER_PATH"] = str(lessons_env.kernel(folder, python))
    return python, environment


@pytest.mark.slow
def test_lessons_run_from_a_wheel_in_a_folder_of_their_own(tmp_path, wheel):
    """The README's pip route: gpukit from its wheel with its lessons extra and nothing of the suite's dev packages;
    `gpukit lessons DIR`, then the lessons that read shipped files (05) or YAML (05) and the doctor (00) in a kernel
    of that environment."""
    python, environment = _lessons_kernel(tmp_path, wheel)
    found = subprocess.run(
        [python, "-c", "import gpukit; print(gpukit.__file__)"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert Path(found).is_relative_to(tmp_path / "venv"), found  # the wheel's gpukit, not the clone's
    for missing in ("pytest", "transformers", "playwright", "jupyterlab"):  # dev's (or lab's), not the lessons'
        assert subprocess.run([python, "-c", f"import {missing}"], capture_output=True, env=environment).returncode
    lessons = tmp_path / "my lessons"
    subprocess.run([python, "-m", "gpukit", "lessons", str(lessons)], env=environment, check=True, timeout=60)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval-lax",
            "--nbval-kernel-name",
            lessons_env.KERNEL_NAME,
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


def test_every_lesson_import_is_in_the_lessons_extra():
    """What each lesson imports at its top (its setup cell) comes with gpukit[lessons]: the suite runs every lesson
    in a kernel of that environment (make test's --nbval-kernel-name), this names a missing one at once."""
    provided = {name for name in lessons_env.closure() if name != "gpukit"}
    top_level = {
        name
        for distribution in map(importlib.metadata.distribution, provided)
        for name in (distribution.read_text("top_level.txt") or "").split()
    } | {path.parts[0].removesuffix(".py") for name in provided for path in _files(name)}
    for lesson in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        code = "\n".join(
            "".join(cell["source"]) for cell in json.loads(lesson.read_text())["cells"] if cell["cell_type"] == "code"
        )
        imported = set(re.findall(r"^(?:import|from) (\w+)", code, re.MULTILINE)) - set(sys.stdlib_module_names)
        assert imported - {"gpukit"} <= top_level, (lesson.name, imported - top_level)


def _files(name: str) -> list:
    return [path for path in importlib.metadata.distribution(name).files or [] if path.parts and path.parts[0] != ".."]


def _run_the_install_cell(lesson: Path, versions: dict[str, str] | None = None) -> list[list[str]]:
    """Run the lesson's install cell as where gpukit is missing (Colab, Kaggle), with the installed `versions` of
    torch and torchvision (default: this interpreter's); the commands it would run."""
    import importlib.util

    cell = next(cell for cell in json.loads(lesson.read_text())["cells"] if cell["cell_type"] == "code")
    commands = []
    real_find_spec, real_version = importlib.util.find_spec, importlib.metadata.version
    with (
        mock.patch("importlib.util.find_spec", lambda name: None if name == "gpukit" else real_find_spec(name)),
        mock.patch("importlib.metadata.version", lambda name: (versions or {}).get(name) or real_version(name)),
        mock.patch("subprocess.run", lambda command, **_: commands.append(command)),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        exec("".join(cell["source"]), {})
    return commands


def _install_command_of_the_first_cell(lesson: Path) -> list[str]:
    """What the lesson's install cell runs where gpukit is missing: its pip arguments."""
    [command] = _run_the_install_cell(lesson)
    return command[command.index("install") + 1 :]


@pytest.mark.parametrize(
    "lesson", sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")), ids=lambda p: p.stem.split("_")[0]
)
def test_the_install_cell_names_a_too_old_torch_and_the_command_before_pip_runs(lesson):
    with pytest.raises(SystemExit) as stopped:
        _run_the_install_cell(lesson, {"torch": "2.10.0+cu126", "torchvision": "0.25.0+cu126"})
    message = str(stopped.value)
    assert "gpukit needs torch >= 2.11; this runtime has torch 2.10.0+cu126" in message, message
    assert '!pip install -q "torch>=2.11" "torchvision>=0.26"' in message and "restart the runtime" in message
    # A supported torch (a Colab build's local version, a nightly) goes on to pip with the lessons extra.
    for torch_version in ("2.11.0+cu126", "2.12.0.dev20260101+cpu"):
        [command] = _run_the_install_cell(lesson, {"torch": torch_version, "torchvision": "0.26.0"})
        assert f"torch=={torch_version}" in command and any(a.startswith("gpukit[lessons] @ git+") for a in command)


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
        # gpukit[lessons]: what the install cell asks for beyond the core (Colab has most of it)
        **{name: "99.0" for name in ("pyyaml", "webdataset", "tensorboard", "timm", "torchao", "nvidia-ml-py")},
    }
    for name, version in installed.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("")


@pytest.mark.slow
@pytest.mark.parametrize("torch_version", ["2.11.0", "2.10.0"])
def test_the_install_cell_keeps_the_runtimes_torch(tmp_path, wheel, torch_version):
    """Colab's torch stays: 2.11 (supported) is kept and only gpukit is installed; 2.10 (too old, which the cell names
    before pip runs) would stop pip with a conflict rather than pull a new torch."""
    arguments = _install_command_of_the_first_cell(ROOT / "notebooks" / "01_train_a_cnn.ipynb")
    spec = next(argument for argument in arguments if argument.startswith("gpukit[lessons] @ git+"))
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
        "gpukit[lessons]",
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


def test_the_example_ci_workflow_installs_gpukit_nbval_and_pytest_from_the_projects_url():
    """A user's CI needs gpukit and what runs notebooks as tests, not gpukit's own test kit (gpukit[dev]: a browser
    driver, transformers), and the project's real address, not a placeholder organisation."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["test"]["steps"]
    (install,) = [step["run"] for step in steps if step.get("name") == "Install"]
    commands = [line.split("#")[0].strip() for line in install.splitlines() if "pip install" in line]
    gpukit = [command for command in commands if "gpukit" in command]
    assert gpukit == [f'python -m pip install "gpukit @ git+{_repository()}" nbval pytest'], commands
    assert not any("[dev]" in command for command in commands) and "YOUR-ORG" not in install


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
    for lesson in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
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


def _readme_pip_route() -> list[str]:
    """The README's commands for a pip install, in order."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Without a clone[^\n]*:\s*```bash\n(.*?)```", readme, re.DOTALL)[1]
    return list(filter(None, (line.split("#")[0].strip() for line in block.strip().splitlines())))


@pytest.mark.slow
def test_the_readmes_pip_route_opens_jupyterlab(tmp_path, wheel):
    """`pip install "gpukit[lab] @ …"` then `gpukit lab gpukit-lessons`, literally: in a Python with the wheel and
    exactly what that extra brings, JupyterLab starts (as root too: CI runs as root) on a copy of the lessons."""
    commands = _readme_pip_route()
    (install,) = [command for command in commands if "gpukit[" in command]
    open_lab = commands[-1]
    assert commands[0].endswith("--index-url https://download.pytorch.org/whl/cpu")  # the CPU-only advice, first
    requirement = re.fullmatch(r'pip install "(gpukit\[\w+\]) @ git\+\S+"', install)[1]
    assert open_lab == "gpukit lab gpukit-lessons"
    python = lessons_env.build(tmp_path, gpukit_from=None, roots=[requirement])
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site, str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = ["--no-browser", f"--port={port}", "--ip=127.0.0.1", "--IdentityProvider.token=t0ken"]
    log = tmp_path / "lab.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            [python, "-m", "gpukit", *open_lab.split()[1:], *options],  # `gpukit` is `python -m gpukit`
            cwd=tmp_path,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    status = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token=t0ken", timeout=2)
                    break
                except OSError:
                    assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                    time.sleep(0.5)
            assert status.status == 200
        finally:
            server.terminate()
            server.wait(timeout=30)
    copied = sorted(path.name for path in (tmp_path / "gpukit-lessons").glob("*.ipynb"))
    assert copied == sorted(path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    if os.geteuid() == 0:
        assert "running as root: JupyterLab starts with --allow-root" in log.read_text()


def _make_dry_run(*arguments: str) -> str:
    """What `make` would run here (-n: nothing runs; -B: as on a fresh clone, whatever .venv holds)."""
    command = ["make", "--no-print-directory", "-n", "-B", "-C", str(ROOT), *arguments]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on the PATH")
def test_make_lab_cpu_installs_torchs_cpu_build_first_and_says_so_without_a_gpu():
    cpu = _make_dry_run("setup", "CPU=1").splitlines()
    torch_line = next(index for index, line in enumerate(cpu) if "--index-url" in line)
    assert "pip install --quiet torch torchvision --index-url https://download.pytorch.org/whl/cpu" in cpu[torch_line]
    assert torch_line < next(index for index, line in enumerate(cpu) if '-e ".[dev]"' in line)  # torch first
    default = _make_dry_run("setup")
    assert "--index-url" not in default and "make clean && make lab CPU=1" in default  # the hint, where no nvidia-smi
    assert "--index-url https://download.pytorch.org/whl/cu126" in _make_dry_run(
        "setup", "TORCH_INDEX=https://download.pytorch.org/whl/cu126"
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on the PATH")
@pytest.mark.parametrize("target, extra", [("lab", "lab"), ("test", "dev")])
def test_make_lab_installs_the_lab_extra_make_test_the_dev_extra_and_each_ends_with_the_doctor(target, extra):
    """A learner gets JupyterLab and what the lessons import, not the tests' playwright and transformers; every
    set-up ends with the doctor's verdict (`gpukit doctor` exits 1 where what the lessons import fails)."""
    lines = _make_dry_run(target).splitlines()
    (install,) = [line for line in lines if "pip install" in line]
    assert f'-e ".[{extra}]"' in install and "nbstripout" in install, install
    doctor = lines.index(".venv/bin/gpukit doctor")
    assert any(line.startswith("touch ") for line in lines[doctor + 1 :]), "the stamp is written after the doctor"
    assert not any(line.startswith("touch ") for line in lines[:doctor]), "a failed doctor must leave no stamp"
    (overrides,) = [line for line in lines if "overrides.d" in line]
    assert "cp tools/jupyterlab-overrides.json .venv/share/jupyter/lab/settings/overrides.d/" in overrides
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(name.startswith(("playwright", "transformers", "ruff")) for name in dependencies["lab"])


def test_jupyterlab_hears_no_news_from_make_lab():
    """JupyterLab's "official Jupyter news?" pop-up covers the lessons: off, in the file make setup copies into the
    .venv (tests/test_browser.py runs JupyterLab with the same file)."""
    overrides = json.loads((ROOT / "tools" / "jupyterlab-overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on the PATH")
def test_make_lab_passes_the_users_jupyterlab_options_through_gpukit_lab():
    assert (
        _make_dry_run("lab", "LAB_ARGS=--ip=0.0.0.0 --port=8888")
        .splitlines()[-1]
        .endswith("/gpukit lab notebooks/ --ip=0.0.0.0 --port=8888")
    )


def test_the_git_filter_make_setup_installs_leaves_every_committed_lesson_as_it_is():
    """make setup installs nbstripout as the clone's git filter (lessons run in JupyterLab leave no outputs in git).
    It must not change a committed lesson: nbstripout renumbers cell ids unless told --keep-id."""
    clean = subprocess.run(
        ["git", "config", "--get", "filter.nbstripout.clean"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if not clean:
        pytest.skip("make setup has not installed the nbstripout git filter in this clone")
    assert "--keep-id" in clean
    for lesson in sorted((ROOT / "notebooks").glob("*.ipynb")):
        filtered = subprocess.run(clean, shell=True, input=lesson.read_bytes(), capture_output=True, check=True)
        assert filtered.stdout == lesson.read_bytes(), lesson.name
    executed = json.loads(lesson.read_text())
    executed["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
    executed["cells"][1]["execution_count"] = 1
    stripped = subprocess.run(clean, shell=True, input=json.dumps(executed).encode(), capture_output=True)
    assert json.loads(stripped.stdout) == json.loads(lesson.read_text()), lesson.name  # outputs gone, ids kept
