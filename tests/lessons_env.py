"""A Python environment with exactly what `pip install "gpukit[lessons]"` brings, for running the lessons in it.

The suite's own environment has gpukit's `dev` extra: pytest, transformers, Playwright and the rest, which a learner's
`pip install` does not bring. A lesson that imports something only `dev` happens to pull in (yaml, say) passes here
and fails for the learner. So the lessons run in a kernel whose Python sees gpukit's requirements with the `lessons`
extra, followed through every package's own requirements, plus ipykernel to be a kernel at all, and nothing else.

Nothing is downloaded or copied: the environment is a venv without pip whose site-packages holds one `.pth` file
naming a folder of symbolic links, one for each top-level file or folder a required distribution installed (from its
RECORD), into this environment's site-packages. Built in about a second.

    python tests/lessons_env.py DIR      # build it in DIR and print its Python
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import sysconfig
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
KERNEL_NAME = "gpukit-lessons"  # make test: --nbval-kernel-name gpukit-lessons
ROOTS = ["gpukit[lessons]", "ipykernel"]  # what the lessons' kernel may import: gpukit's lessons extra, and a kernel


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _gpukit_requirements(extras: set[str]) -> list[Requirement]:
    """gpukit's requirements with `extras`, read from pyproject.toml (an extra may name gpukit's other extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, todo, seen = [Requirement(text) for text in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in map(Requirement, project["optional-dependencies"][extra]):
            if _name(requirement.name) == "gpukit":
                todo += sorted(requirement.extras)
            else:
                found.append(requirement)
    return found


def closure(roots: list[str] = ROOTS) -> dict[str, importlib.metadata.Distribution]:
    """Every installed distribution `roots` need, followed through their requirements (markers evaluated here)."""
    todo: list[tuple[Requirement, str]] = []
    for root in map(Requirement, roots):
        if _name(root.name) == "gpukit":
            todo += [(requirement, "") for requirement in _gpukit_requirements(set(root.extras))]
        else:
            todo.append((root, ""))
    found: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _name(requirement.name)
        if name not in found:
            found[name] = importlib.metadata.distribution(requirement.name)  # not installed: PackageNotFoundError
            wanted = found[name].requires or []
            todo += [(Requirement(text), "") for text in wanted]
        for extra_name in requirement.extras:  # e.g. jupyter-server[foo]: that extra's requirements too
            todo += [(Requirement(text), extra_name) for text in found[name].requires or []]
    return found


def _top_level_entries(distribution: importlib.metadata.Distribution) -> set[tuple[str, ...]]:
    """The paths a distribution installed into site-packages, cut to their first one or two parts."""
    if distribution.files is None:
        raise RuntimeError(f"{distribution.metadata['Name']} has no RECORD: reinstall it with pip")
    return {tuple(file.parts[:2]) for file in distribution.files if file.parts and file.parts[0] != ".."}


def link_farm(folder: Path, distributions: dict[str, importlib.metadata.Distribution]) -> None:
    """Symbolic links in `folder` to what `distributions` installed. A folder that several distributions share (a
    namespace package such as nvidia/ or google/) becomes a real folder holding links to each one's part only."""
    entries: dict[str, set[tuple[str, ...]]] = defaultdict(set)  # top-level name -> its installed paths, cut
    owners: dict[str, set[str]] = defaultdict(set)  # top-level name -> the distributions that installed into it
    sources: dict[str, Path] = {}
    for name, distribution in distributions.items():
        site = Path(distribution.locate_file(""))
        for entry in _top_level_entries(distribution):
            entries[entry[0]].add(entry)
            owners[entry[0]].add(name)
            sources[entry[0]] = site
    folder.mkdir(parents=True, exist_ok=True)
    for top, cut in entries.items():
        source = sources[top] / top
        if len(owners[top]) == 1 or not source.is_dir():
            (folder / top).symlink_to(source)
            continue
        (folder / top).mkdir()
        for second in {entry[1] for entry in cut if len(entry) == 2}:
            (folder / top / second).symlink_to(source / second)


def build(folder: Path, gpukit_from: Path | None = ROOT, roots: list[str] = ROOTS) -> Path:
    """A venv in `folder` that sees only `roots` (and gpukit from `gpukit_from`, a folder holding the package; None:
    no gpukit, to install one into it). Returns its Python."""
    folder = Path(folder)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True, timeout=120)
    python = folder / "venv" / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([python, "-c", where], capture_output=True, text=True, check=True).stdout.strip())
    distributions = {name: d for name, d in closure(roots).items() if name != "gpukit"}
    link_farm(folder / "packages", distributions)
    paths = [str(gpukit_from)] if gpukit_from is not None else []
    (site / "lessons_env.pth").write_text("\n".join([*paths, str(folder / "packages")]) + "\n")
    return python


def kernel(folder: Path, python: Path) -> Path:
    """A Jupyter data folder in `folder` whose kernel KERNEL_NAME runs `python`; put it first in JUPYTER_PATH."""
    spec = folder / "jupyter" / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "gpukit lessons", "language": "python"})
    )
    return folder / "jupyter"


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
    print("site-packages of this environment:", sysconfig.get_path("purelib"))
