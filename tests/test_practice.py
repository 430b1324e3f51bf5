"""Every exercise of every lesson, run three ways against its lesson's setup cell: as shipped (not attempted: it
passes and says so), with its solution (its check passes), and with each typical wrong answer listed beside it (its
check fails, with the feedback meant for that answer). And each prediction's check measures its reference here: with
the measured quantity patched to read 2x or 0.5x (a machine twice as fast or as slow), the same solution fails.

The cells come from the lesson when it holds them (found by their metadata, gpukit.practice.cells), else from the
exercise's module, as tools/practice_cells.py would insert them: the same harness runs before and after insertion.
The lesson's setup cell runs once per lesson, in this process (no kernel to start); each exercise runs its cells in a
fresh copy of that namespace.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from gpukit import CheckFailed, practice
from gpukit.practice import cells as practice_cells
from gpukit.practice.exercise import KINDS, Prediction, is_unchanged, progress, tolerance_from

ROOT = Path(__file__).parent.parent
LESSONS = practice.lessons()
EXERCISES = [(lesson, exercise) for lesson in LESSONS for exercise in lesson.EXERCISES]
ON_GPU = torch.cuda.is_available()


def notebook(lesson) -> dict:
    return json.loads((ROOT / "notebooks" / f"{lesson.LESSON}.ipynb").read_text())


def cells_for(lesson, exercise) -> dict[str, str]:
    """{role: source}: the lesson's own cells where it holds them, else the ones that would be inserted."""
    found = practice_cells.cells_in(notebook(lesson)).get(exercise.key)
    if found is None:
        found = practice_cells.cells_in({"cells": practice_cells.practice_cells(lesson)})[exercise.key]
    return found


@pytest.fixture(scope="module")
def setups() -> dict:
    """Each lesson's namespace after its setup cell, made once: {lesson name: (namespace, threads it chose)}."""
    made = {}

    def setup(lesson) -> dict:
        if lesson.LESSON not in made:
            namespace = {"__name__": "__main__", "display": print}
            run(practice_cells.setup_source(notebook(lesson)), namespace)
            made[lesson.LESSON] = (namespace, torch.get_num_threads())
        namespace, threads = made[lesson.LESSON]
        torch.set_num_threads(threads)  # the suite's fixtures restore threads after each test
        return dict(namespace)

    return setup


def run(source: str, namespace: dict) -> str:
    """Execute a cell's source in `namespace`; return what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "<cell>", "exec"), namespace)
    return printed.getvalue()


@pytest.mark.parametrize(("lesson", "exercise"), EXERCISES, ids=[exercise.key for _, exercise in EXERCISES])
def test_exercise_as_shipped_solved_and_wrong(setups, lesson, exercise):
    cells = cells_for(lesson, exercise)
    printed = run(cells["answer"] + "\n" + cells["check"], setups(lesson))
    assert printed.startswith(f"not attempted yet: {exercise.key}: ") and len(printed.splitlines()) == 1, printed

    namespace = setups(lesson)
    if exercise.needs_gpu and not ON_GPU:  # an answer here is not judged: the check says why, and passes
        namespace[exercise.answer] = object()
        printed = run(cells["check"], namespace)
        assert printed.startswith(f"skipped: {exercise.key}: ") and "no CUDA GPU" in printed, printed
        pytest.skip(f"{exercise.key} needs a CUDA GPU: its solution and wrong answers run only on one")
    printed = run(exercise.solution_code + "\n" + cells["check"], namespace)
    assert printed.startswith(f"check passed: {exercise.key}: "), printed
    assert len(printed.strip().splitlines()) == 1, printed  # one plain line, as gk.check prints
    solved = namespace[exercise.answer]

    if exercise.kind == "fix":
        # the premise: the setup as shipped, judged as an answer, fails here
        shipped = setups(lesson)
        run(cells["answer"], shipped)
        assert not exercise.judge_answer(shipped[exercise.answer]).passed, exercise.key

    wrong_values = []
    for wrong in exercise.wrong_answers:
        if wrong.needs_gpu and not ON_GPU:
            continue  # only wrong where the mistake shows: on a GPU
        namespace = setups(lesson)
        with pytest.raises(CheckFailed) as failure:
            run(wrong.code + "\n" + cells["check"], namespace)
        message = str(failure.value)
        assert message.startswith(f"check failed: {exercise.key}: ") and wrong.feedback in message, (
            wrong.code,
            message,
        )
        wrong_values.append(namespace[exercise.answer])
    if isinstance(exercise, Prediction) and not exercise.integer:
        # a 2x error among the wrong answers of every numeric one
        assert any(abs(value / solved - 2) < 0.01 or abs(value / solved - 0.5) < 0.01 for value in wrong_values), (
            solved,
            wrong_values,
        )


PREDICTIONS = [(lesson, exercise) for lesson, exercise in EXERCISES if isinstance(exercise, Prediction)]


@pytest.mark.parametrize(("lesson", "exercise"), PREDICTIONS, ids=[exercise.key for _, exercise in PREDICTIONS])
@pytest.mark.parametrize("machine", [2.0, 0.5], ids=["2x", "half"])
def test_prediction_measures_its_reference_here(setups, monkeypatch, lesson, exercise, machine):
    # On a machine where the measured quantity reads `machine` times what it reads here, the solution worked out here
    # must fail: the check compares with what it measures, not with a number it was given.
    if exercise.needs_gpu and not ON_GPU:
        pytest.skip(f"{exercise.key} needs a CUDA GPU")
    measure = exercise.measure
    monkeypatch.setattr(exercise, "measure", lambda: [machine * value for value in measure()])
    namespace = setups(lesson)
    with pytest.raises(CheckFailed, match=re.escape(exercise.key)):
        run(exercise.solution_code + "\n" + cells_for(lesson, exercise)["check"], namespace)


def test_every_lesson_has_its_exercises():
    assert [lesson.LESSON for lesson in LESSONS] == sorted(path.stem for path in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(EXERCISES) >= 30
    for lesson in LESSONS:
        kinds = [exercise.kind for exercise in lesson.EXERCISES]
        assert 2 <= len(kinds) <= 4 and {"fix", "build"} & set(kinds), (lesson.LESSON, kinds)
        number = lesson.LESSON.split("_")[0]
        assert all(exercise.key.startswith(f"{number}.") for exercise in lesson.EXERCISES), lesson.LESSON
        names = [exercise.name for exercise in lesson.EXERCISES]
        assert len(set(names)) == len(names) and all(
            getattr(lesson, name) is e for name, e in zip(names, lesson.EXERCISES)
        )
    answers = [exercise.answer for _, exercise in EXERCISES]
    assert all(kind in KINDS for kind in (exercise.kind for _, exercise in EXERCISES))
    assert len(answers) == len({(lesson.LESSON, exercise.answer) for lesson, exercise in EXERCISES})


def test_practice_sections_insert_once_before_the_closing_section():
    for lesson in LESSONS:
        lesson_notebook = notebook(lesson)
        once = practice_cells.insert(json.loads(json.dumps(lesson_notebook)), lesson)
        twice = practice_cells.insert(json.loads(json.dumps(once)), lesson)
        assert once == twice, lesson.LESSON  # inserting again replaces, never adds
        sources = ["".join(cell["source"]) for cell in once["cells"]]
        closing = next(i for i, source in enumerate(sources) if source.splitlines()[:1] == [lesson.BEFORE])
        assert sources[closing - 1].startswith("from gpukit.practice import"), lesson.LESSON  # the progress cell
        ids = [cell["id"] for cell in once["cells"]]
        assert len(set(ids)) == len(ids), lesson.LESSON
        assert set(practice_cells.cells_in(once)) == {e.key for e in lesson.EXERCISES} | {once_key(lesson)}


def once_key(lesson) -> str:
    return f"{lesson.LESSON.split('_')[0]}.practice"


def test_unattempted_means_the_cell_as_shipped():
    starter = "def fixed(x):\n    return x + 1  # the broken line\n"
    shipped, edited = {}, {}
    exec(starter, shipped)
    exec(starter.replace("x + 1", "x + 2"), edited)
    exec("def fixed(x):\n    # a comment changes nothing\n    return x + 1\n", commented := {})
    assert is_unchanged(..., starter) and is_unchanged(shipped["fixed"], starter)
    assert is_unchanged(commented["fixed"], starter)
    assert not is_unchanged(edited["fixed"], starter) and not is_unchanged(3.0, starter)


def test_tolerance_comes_from_the_spread_within_floor_and_cap():
    assert tolerance_from([10.0], floor=0.05) == 0.05  # counted once: the floor
    assert tolerance_from([9.0, 10.0, 11.0], floor=0.05) == pytest.approx(0.2)  # the range over the median
    assert tolerance_from([1.0, 10.0, 20.0, 30.0], floor=0.05) == 0.5  # never wider: a 2x error always fails


def test_hints_solution_and_progress_speak_in_plain_lines(capsys):
    exercise = LESSONS[0].EXERCISES[0]
    exercise.hint()
    exercise.hint()
    exercise.solution()
    progress(LESSONS[0].EXERCISES)
    printed = capsys.readouterr().out
    assert (
        printed.startswith(f"hint 1 of {len(exercise.hints)}: ") and f"\nhint 2 of {len(exercise.hints)}: " in printed
    )
    assert exercise.solution_code.strip() in printed
    assert "practice: " in printed and exercise.key in printed
    with pytest.raises(ValueError, match="hints 1 to"):
        exercise.hint(len(exercise.hints) + 1)


@pytest.mark.parametrize("lesson", LESSONS, ids=[lesson.LESSON.split("_")[0] for lesson in LESSONS])
def test_a_lesson_holding_practice_cells_holds_the_modules_own(lesson):
    # Once tools/practice_cells.py has inserted them, a lesson's Practice cells are what gpukit/practice says:
    # an exercise changed in its module and not re-inserted (or a cell edited by hand) fails here.
    lesson_notebook = notebook(lesson)
    if not practice_cells.cells_in(lesson_notebook):
        pytest.skip(f"{lesson.LESSON} holds no Practice cells yet: python tools/practice_cells.py inserts them")
    assert practice_cells.insert(json.loads(json.dumps(lesson_notebook)), lesson) == lesson_notebook, (
        f"{lesson.LESSON}: run python tools/practice_cells.py {lesson.LESSON.split('_')[0]}"
    )


@pytest.mark.parametrize("machine", [2.0, 0.5], ids=["2x", "half"])
def test_the_largest_batch_is_measured_at_the_answer(setups, monkeypatch, machine):
    # 07.largest_batch judges the learner's batch by real steps at it and 10% above it: on a machine whose steps
    # took twice (or half) the memory, the batch worked out here must fail.
    lesson07 = next(lesson for lesson in LESSONS if lesson.LESSON.startswith("07_"))
    peak = lesson07._peak
    monkeypatch.setattr(lesson07, "_peak", lambda batch: int(machine * peak(batch)))
    with pytest.raises(CheckFailed, match="07.largest_batch"):
        run(
            lesson07.largest_batch.solution_code + "\n" + cells_for(lesson07, lesson07.largest_batch)["check"],
            setups(lesson07),
        )
