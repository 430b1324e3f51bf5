"""The lessons read like a book: short cells a learner reads, each check in a cell of its own, collapsed.

A check cell (one that calls gk.check, gk.check_between or gk.skip_check, or asserts: gpukit.commands.site.is_check)
opens collapsed in JupyterLab and on the site (its `jupyter.source_hidden` metadata), so the proof is one click away
and never in the way; the Practice sections' check cells are the learner's own and stay open. No code cell is longer
than one screen (40 lines).
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from gpukit.commands import site

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSONS = sorted(NOTEBOOKS.glob(site.LESSON_GLOB))
MOST_LINES = 40


def code_cells(cells: list[dict]) -> list[tuple[int, dict, str]]:
    return [(index, cell, "".join(cell["source"])) for index, cell in enumerate(cells) if cell["cell_type"] == "code"]


def open_check_cells(cells: list[dict]) -> list[int]:
    """Indices of the check cells that open expanded (Practice cells, the learner's own, aside)."""
    return [
        index
        for index, cell, source in code_cells(cells)
        if site.is_check(source)
        and "role" not in cell.get("metadata", {}).get("gpukit", {})
        and not cell.get("metadata", {}).get("jupyter", {}).get("source_hidden")
    ]


def long_cells(cells: list[dict]) -> dict[int, int]:
    """Code cells over MOST_LINES lines: {index: lines}."""
    counts = {index: len(source.splitlines()) for index, _, source in code_cells(cells)}
    return {index: count for index, count in counts.items() if count > MOST_LINES}


def lesson_cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def test_there_are_lessons():
    assert len(LESSONS) >= 12, LESSONS


@pytest.mark.parametrize("path", LESSONS, ids=[path.stem[:3] for path in LESSONS])
def test_every_check_cell_opens_collapsed(path):
    assert open_check_cells(lesson_cells(path)) == [], f"{path.name}: set these check cells' jupyter.source_hidden"


@pytest.mark.parametrize("path", LESSONS, ids=[path.stem[:3] for path in LESSONS])
def test_no_code_cell_is_longer_than_a_screen(path):
    assert long_cells(lesson_cells(path)) == {}, path.name


def test_the_rules_find_an_open_check_and_a_long_cell():
    """Each rule finds what it is for, and passes what it allows: a check collapsed, a Practice check open, a
    cell of exactly 40 lines."""
    check = nbformat.v4.new_code_cell('gk.check(loss < 1, "the loss fell")')
    collapsed = nbformat.v4.new_code_cell("assert loss < 1", metadata={"jupyter": {"source_hidden": True}})
    practice = nbformat.v4.new_code_cell("practice.x.check(y)\nassert True", metadata={"gpukit": {"role": "check"}})
    teaching = nbformat.v4.new_code_cell("history = gk.fit(model, data)")
    cells = [teaching, check, collapsed, practice]
    assert open_check_cells(cells) == [1]
    fits, over = ("x = 1\n" * MOST_LINES).rstrip(), ("x = 1\n" * (MOST_LINES + 1)).rstrip()
    assert long_cells([nbformat.v4.new_code_cell(fits), nbformat.v4.new_code_cell(over)]) == {1: MOST_LINES + 1}
