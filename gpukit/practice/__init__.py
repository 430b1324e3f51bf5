"""Practice: exercises in every lesson, whose checks measure on the learner's machine.

In a lesson's Practice section:

    from gpukit.practice import lesson03 as practice
    practice.model_state.check(model_state_prediction)   # measures here, judges, says what is likely wrong
    practice.model_state.hint()                          # the next hint; hint(2) a given one
    practice.model_state.solution()                      # our solution, printed
    practice.progress()                                  # this lesson's exercises and what their checks said

`exercise.py` is the machinery (one module to read); `lessonNN.py` holds lesson NN's exercises, each with its
solution and the typical wrong answers the suite checks it against; `cells.py` writes them into the lessons.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .exercise import KINDS, Exercise, Mistake, Prediction, Verdict, WrongAnswer, progress

__all__ = ["KINDS", "LESSONS", "Exercise", "Mistake", "Prediction", "Verdict", "WrongAnswer", "lessons", "progress"]

# One module per lesson, in reading order.
LESSONS = (
    "lesson00",
    "lesson01",
    "lesson02",
    "lesson03",
    "lesson04",
    "lesson05",
    "lesson06",
    "lesson06b",
    "lesson07",
    "lesson08",
    "lesson09",
    "lesson10",
)


def lessons() -> list[ModuleType]:
    """Every lesson's exercise module, in reading order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in LESSONS]
