"""Files that travel with gpukit: the lessons and the cluster examples.

In a clone they sit beside the package (notebooks/, examples/cluster/); pyproject.toml ships them in the
wheel as the packages gpukit.lessons and gpukit.cluster. `folder` finds them either way, so a lesson never
needs a path into the repository, and `copy_lessons` (the `gpukit lessons DIR` command) gives pip users
their own copy to open and edit, as d2l ships its notebooks.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from .files import writable_folder

IN_A_CLONE = {"lessons": "notebooks", "cluster": "examples/cluster"}  # name -> folder beside the package


def folder(name: str) -> Path:
    """The folder of the shipped files `name` ("lessons" or "cluster"): in a clone, or installed."""
    if name not in IN_A_CLONE:
        raise ValueError(f"folder({name!r}): gpukit ships {', '.join(map(repr, IN_A_CLONE))}")
    beside = Path(__file__).resolve().parents[1] / IN_A_CLONE[name]
    if beside.is_dir():  # a clone (or an editable install of one): the files as the repository has them
        return beside
    spec = importlib.util.find_spec(f"gpukit.{name}")  # a wheel: gpukit/lessons, gpukit/cluster
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"this gpukit has no {name} (neither {beside} nor gpukit/{name}): reinstall it from a wheel or a clone"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def copy_lessons(destination: str | Path, overwrite: bool = False, name: str = "destination") -> list[Path]:
    """Copy every lesson notebook into `destination` (made if missing) and return the copies' paths.

    A lesson already there is kept (your edits are never lost) unless `overwrite`: the error names them.
    A destination that cannot be a folder (a file, a path through a file, /proc) is a ValueError naming it as
    `name` (the command line's DIR), before anything is copied.
    """
    destination = writable_folder(destination, name, "the lessons are copied into it")
    lessons = sorted(folder("lessons").glob("[0-9][0-9]*_*.ipynb"))
    if not lessons:
        raise FileNotFoundError(f"no lessons in {folder('lessons')}: reinstall gpukit")
    existing = [destination / lesson.name for lesson in lessons if (destination / lesson.name).exists()]
    if existing and not overwrite:
        names = ", ".join(path.name for path in existing)
        raise FileExistsError(f"{destination} already has {names}: choose another folder, or pass --force to replace")
    destination.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(lesson, destination / lesson.name)) for lesson in lessons]
