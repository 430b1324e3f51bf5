"""A lesson's Practice section as notebook cells, and how to find them again in a lesson.

Every cell this module writes carries `{"gpukit": {"exercise": KEY, "role": ROLE}}` in its metadata (ROLE: "intro",
"prompt", "answer", "check", "progress"), so that tools and tests find the exercises in a lesson whatever else moves
around them, and re-inserting them replaces the old cells instead of adding new ones. Cell ids are derived from the
key, so re-inserting keeps them.
"""

from __future__ import annotations

import re
from types import ModuleType

from .exercise import KINDS, Exercise

__all__ = ["ROLES", "cells_in", "insert", "practice_cells", "setup_source"]

ROLES = ("intro", "prompt", "answer", "check", "progress")
SECTION = "## Practice"


def _cell(kind: str, source: str, key: str, role: str) -> dict:
    cell_id = re.sub(r"[^a-zA-Z0-9-]", "-", f"practice-{key}-{role}")[:64]
    cell = {
        "cell_type": kind,
        "id": cell_id,
        "metadata": {"gpukit": {"exercise": key, "role": role}},
        "source": source.strip("\n").splitlines(keepends=True),
    }
    if kind == "code":
        cell |= {"execution_count": None, "outputs": []}
    return cell


def _intro(lesson: ModuleType) -> str:
    number = lesson.LESSON.split("_")[0]
    kinds = sorted({exercise.kind for exercise in lesson.EXERCISES}, key=list(KINDS).index)
    return f"""{SECTION}

{len(lesson.EXERCISES)} exercises ({", ".join(KINDS[kind] for kind in kinds)}). For each: write your answer in its
cell, run it, then run the check under it. Every check **measures on your machine** what it judges you against (no
number is typed into the kit), and says by how much you missed and what the likely mistake is. Stuck?
`practice.NAME.hint()` gives a hint (call it again for the next), `practice.NAME.solution()` prints ours. An
exercise you have not tried says so and passes: the lesson still runs top to bottom. The last cell shows your
progress. (The exercises' code: `gpukit/practice/lesson{number}.py`, solutions included.)"""


def _check_source(lesson: ModuleType, exercise: Exercise) -> str:
    module = lesson.__name__.rsplit(".", 1)[1]
    return f"""from gpukit.practice import {module} as practice  # practice.{exercise.name}.hint(), .solution()

practice.{exercise.name}.check({exercise.answer})"""


def practice_cells(lesson: ModuleType) -> list[dict]:
    """The Practice section of `lesson` (a gpukit.practice.lessonNN module): intro, then for each exercise its prompt,
    the learner's cell as shipped and its check, then the progress cell."""
    module = lesson.__name__.rsplit(".", 1)[1]
    number = lesson.LESSON.split("_")[0]
    cells = [_cell("markdown", _intro(lesson), f"{number}.practice", "intro")]
    for exercise in lesson.EXERCISES:
        gpu = f"\n\n*Needs a CUDA GPU: {exercise.needs_gpu}.*" if exercise.needs_gpu else ""
        if exercise.cpu_variant:
            gpu += f" On a CPU, exercise `{exercise.cpu_variant}` teaches the same idea."
        cells += [
            _cell("markdown", exercise.prompt + gpu, exercise.key, "prompt"),
            _cell("code", exercise.starter, exercise.key, "answer"),
            _cell("code", _check_source(lesson, exercise), exercise.key, "check"),
        ]
    progress = f"from gpukit.practice import {module} as practice\n\npractice.progress()  # this lesson's exercises"
    return cells + [_cell("code", progress, f"{number}.practice", "progress")]


def _role(cell: dict) -> tuple[str, str] | None:
    found = cell.get("metadata", {}).get("gpukit", {})
    return (found["exercise"], found["role"]) if "exercise" in found and "role" in found else None


def insert(notebook: dict, lesson: ModuleType) -> dict:
    """`notebook` with `lesson`'s Practice section before the markdown cell whose first line is `lesson.BEFORE`
    (the lesson's closing section), replacing any Practice cells inserted before. Returns the notebook, changed."""
    kept = [cell for cell in notebook["cells"] if _role(cell) is None]
    headings = [
        i
        for i, cell in enumerate(kept)
        if cell["cell_type"] == "markdown" and "".join(cell["source"]).splitlines()[:1] == [lesson.BEFORE]
    ]
    if len(headings) != 1:
        raise ValueError(
            f"{lesson.LESSON}: expected one markdown cell starting {lesson.BEFORE!r}, found {len(headings)}; "
            "set BEFORE in its gpukit.practice module to the heading the Practice section goes before"
        )
    at = headings[0]
    notebook["cells"] = kept[:at] + practice_cells(lesson) + kept[at:]
    return notebook


def cells_in(notebook: dict) -> dict[str, dict[str, str]]:
    """{exercise key: {role: source}} of the Practice cells found in `notebook` by their metadata."""
    found: dict[str, dict[str, str]] = {}
    for cell in notebook["cells"]:
        if (role := _role(cell)) is not None:
            found.setdefault(role[0], {})[role[1]] = "".join(cell["source"])
    return found


def setup_source(notebook: dict) -> str:
    """The lesson's setup cell: the first code cell that calls gk.detect() (after the install cell)."""
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "gk.detect()" in source:
            return source
    raise ValueError("no setup cell (a code cell calling gk.detect()) in this notebook")
