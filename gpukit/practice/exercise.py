"""What an exercise is: `check(answer)`, `hint(level)` and `solution()`, in the style of Kaggle Learn's learntools.

A lesson's exercise is three cells: what to do (markdown), the learner's cell, shipped with a blank (`...` for a
number, a function to write or to fix), and a check cell:

    from gpukit.practice import lesson03 as practice
    practice.predict_peak.check(peak_prediction)

`check` measures its own reference on this machine, every time (never a number typed into the kit), and judges the
answer against it, in one plain line as `gk.check` prints them:

    check passed: 03.predict_peak: your 1.01 MB is 0.98x the measured peak of 1.03 MB (allowed 0.91x to 1.10x)

A wrong answer raises `gk.CheckFailed` saying by how much and in which direction it missed and, where the miss looks
like a known mistake, which one ("did you count the gradients twice?"). An unattempted exercise (the cell as
shipped) says so and passes, so that a lesson runs as a test unchanged:

    not attempted yet: 03.predict_peak: replace the ... in your cell with your prediction, then run this cell again

Kinds: *predict* (a number, judged within a tolerance derived from the measurement's own spread), *fix* (a broken or
slow setup, shipped in the learner's cell: the check runs the learner's version and measures the result), *build*
(a piece of the kit written by hand: the check runs it beside the kit's and compares). `progress(exercises)` prints
a lesson's exercises with what their last check said.
"""

from __future__ import annotations

import math
import numbers
import statistics
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..claims import CheckFailed, _number

__all__ = [
    "KINDS",
    "Exercise",
    "Mistake",
    "Prediction",
    "Verdict",
    "WrongAnswer",
    "compare",
    "is_unchanged",
    "progress",
    "tolerance_from",
]

KINDS = {"predict": "predict, then measure", "fix": "fix it", "build": "build it"}
CAP = 0.5  # the widest tolerance: allowed answer ÷ measured within 1/1.5 to 1.5, so an answer 2x off always fails


@dataclass(frozen=True)
class Mistake:
    """A typical wrong number: the ratio answer ÷ measured that it gives, and the question that names it."""

    ratio: float
    says: str


@dataclass(frozen=True)
class WrongAnswer:
    """A typical wrong answer as the learner's cell would hold it, and words its check's feedback must contain.
    `needs_gpu`: wrong only where the mistake shows (timing without synchronising is right on a CPU)."""

    code: str
    feedback: str
    needs_gpu: bool = False


@dataclass(frozen=True)
class Verdict:
    passed: bool
    says: str  # one line: what was measured against what, and on failure what is likely wrong


def tolerance_from(samples: Sequence[float], floor: float, cap: float = CAP) -> float:
    """The relative tolerance a measurement allows: its spread (twice the interquartile range over the median, or
    the range for fewer than 4 samples), at least `floor` (what the idea itself leaves open), at most `cap`."""
    middle = statistics.median(samples)
    if len(samples) < 2 or middle == 0:
        spread = 0.0
    elif len(samples) < 4:
        spread = (max(samples) - min(samples)) / abs(middle)
    else:
        low, _, high = statistics.quantiles(samples, n=4)
        spread = 2 * (high - low) / abs(middle)
    return min(max(floor, spread), cap)


def _same_code(one: types.CodeType, other: types.CodeType) -> bool:
    """Whether two code objects compile the same statements (comments and line numbers aside)."""
    if (one.co_code, one.co_names, one.co_varnames) != (other.co_code, other.co_names, other.co_varnames):
        return False
    if len(one.co_consts) != len(other.co_consts):
        return False
    for a, b in zip(one.co_consts, other.co_consts):
        if isinstance(a, types.CodeType) and isinstance(b, types.CodeType):
            if not _same_code(a, b):
                return False
        elif type(a) is not type(b) or (a != b and not (isinstance(a, float) and math.isnan(a) and math.isnan(b))):
            return False
    return True


def _functions_in(source: str) -> dict[str, types.CodeType]:
    module = compile(source, "<starter>", "exec")
    return {const.co_name: const for const in module.co_consts if isinstance(const, types.CodeType)}


def is_unchanged(answer: Any, starter: str) -> bool:
    """Whether `answer` is the blank the lesson ships: `...`, or a function compiled from the same statements as the
    one of its name in `starter` (an empty body to write, or the broken code to fix, as shipped), or a tuple of such
    functions."""
    if answer is Ellipsis:
        return True
    if isinstance(answer, tuple) and answer:  # several functions, all as shipped
        return all(is_unchanged(part, starter) for part in answer)
    code = getattr(answer, "__code__", None)
    if code is None:
        return False
    shipped = _functions_in(starter).get(code.co_name)
    return shipped is not None and _same_code(code, shipped)


@dataclass(eq=False)
class Exercise:
    """One exercise of a lesson. `judge(answer)` runs the learner's answer, measures here and returns a Verdict."""

    key: str  # "03.fit_the_budget": the lesson's number and the exercise's name
    kind: str  # a key of KINDS
    title: str
    prompt: str  # markdown: what to do, without the answer
    starter: str  # the learner's cell as the lesson ships it: the blank to fill in, or the code to fix
    answer: str  # the name the check cell passes to check(): "peak_prediction", "make_it_fit"
    solution_code: str  # a cell that replaces the starter and passes, in every profile
    hints: tuple[str, ...]
    wrong_answers: tuple[WrongAnswer, ...]  # typical wrong answers; each must fail with its own feedback
    judge: Callable[[Any], Verdict] | None = None
    needs_gpu: str | None = None  # why the exercise needs a CUDA GPU; None when it runs anywhere
    cpu_variant: str | None = None  # the exercise that teaches the same on a CPU, for a GPU-only one
    status: str = field(default="not run", init=False)  # what the last check said: progress() prints it
    _hints_seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.key}: kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if not self.wrong_answers:
            raise ValueError(f"{self.key}: list at least one typical wrong answer beside the exercise")

    @property
    def name(self) -> str:
        return self.key.split(".", 1)[1]

    def check(self, answer: Any = ...) -> None:
        """Measure here and judge `answer`: print one line, or raise gk.CheckFailed with what is likely wrong."""
        if is_unchanged(answer, self.starter):
            self.status = "not attempted yet"
            blank = "replace the ... in your cell" if answer is Ellipsis else f"change `{self.answer}` in your cell"
            print(f"not attempted yet: {self.key}: {blank}, then run this cell again")
            return
        if self.needs_gpu and not torch.cuda.is_available():
            self.status = "skipped"
            variant = f"; {self.cpu_variant} teaches the same idea on a CPU" if self.cpu_variant else ""
            print(f"skipped: {self.key}: {self.needs_gpu}, and no CUDA GPU is present here{variant}")
            return
        verdict = self.judge_answer(answer)
        self.status = "passed" if verdict.passed else "failed"
        if not verdict.passed:
            raise CheckFailed(f"check failed: {self.key}: {verdict.says} (practice.{self.name}.hint() gives a hint)")
        print(f"check passed: {self.key}: {verdict.says}")

    def judge_answer(self, answer: Any) -> Verdict:
        if self.judge is None:
            raise NotImplementedError(f"{self.key} has no judge")
        return self.judge(answer)

    def hint(self, level: int | None = None) -> None:
        """Print hint `level` (1 is the gentlest); without a level, the next one not yet shown."""
        if level is None:
            level = min(self._hints_seen + 1, len(self.hints))
        if not 1 <= level <= len(self.hints):
            raise ValueError(f"{self.key} has hints 1 to {len(self.hints)}; got level {level}")
        self._hints_seen = max(self._hints_seen, level)
        more = f" (practice.{self.name}.hint({level + 1}) says more)" if level < len(self.hints) else ""
        print(f"hint {level} of {len(self.hints)}: {self.hints[level - 1]}{more}")

    def solution(self) -> None:
        """Print our solution: a cell that replaces yours (try the hints first)."""
        print(f"# {self.key}, our solution: replace your cell with this and run it, then the check\n")
        print(self.solution_code.strip())


@dataclass(eq=False)
class Prediction(Exercise):
    """Predict a number, then measure it: `measure()` returns samples of the quantity (several rounds where it is
    timed, one where it is counted); the answer passes within tolerance_from(samples, floor) of their median."""

    measure: Callable[[], list[float]] | None = None
    what: str = "the measured value"  # "the measured peak"
    unit: str = ""  # printed after each number: " bytes", "x"
    floor: float = 0.05  # the least tolerance: what the idea leaves open (e.g. small temporaries not counted)
    mistakes: tuple[Mistake, ...] = ()
    integer: bool = False  # a count: must be exact

    def judge_answer(self, answer: Any) -> Verdict:
        if isinstance(answer, torch.Tensor) and answer.numel() == 1:
            answer = answer.item()
        if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer):
            return Verdict(False, f"give {self.answer} as a finite number, not {answer!r}")
        answer = float(answer)  # a NumPy number too
        return compare(
            answer,
            self.measure(),
            floor=0.0 if self.integer else self.floor,
            mistakes=self.mistakes,
            what=self.what,
            unit=self.unit,
            advice=self.hints[0],
        )


def compare(
    answer: float,
    samples: Sequence[float],
    *,
    floor: float,
    mistakes: Sequence[Mistake] = (),
    what: str,
    unit: str = "",
    advice: str,
) -> Verdict:
    """Judge `answer` against the median of `samples` measured here, within tolerance_from(samples, floor): the line
    says the ratio, what was measured and what was allowed, and on a miss the listed mistake nearest to the ratio, or
    which way it missed and `advice`."""
    reference = statistics.median(samples)
    tolerance = tolerance_from(samples, floor) if floor > 0 else 0.0
    lo, hi = 1 / (1 + tolerance), 1 + tolerance
    ratio = answer / reference if reference else math.inf
    measured = f"{_number(reference)}{unit}" + (f", median of {len(samples)}" if len(samples) > 1 else "")
    shown = f"your {_number(answer)}{unit} is {ratio:.3g}x {what} ({measured}; allowed {lo:.3g}x to {hi:.3g}x)"
    if lo <= ratio <= hi:
        return Verdict(True, shown)
    return Verdict(False, f"{shown}: {_likely_mistake(ratio, mistakes, advice, 1.3 * hi)}")


def _likely_mistake(ratio: float, mistakes: Sequence[Mistake], advice: str, within: float) -> str:
    """The listed mistake nearest to `ratio` (in log scale) if it is within a factor `within` of it (wider where the
    measurement spreads more), else which way the answer missed, with `advice`."""
    if not ratio > 0 or not math.isfinite(ratio):
        return "the measured value is positive and finite: check the sign and the units of your answer"
    if mistakes:
        nearest = min(mistakes, key=lambda mistake: abs(math.log(ratio / mistake.ratio)))
        if abs(math.log(ratio / nearest.ratio)) <= math.log(within):
            return nearest.says
    return f"too {'high' if ratio > 1 else 'low'}: {advice}"


def progress(exercises: Sequence[Exercise]) -> None:
    """Print each exercise with what its last check in this kernel said: passed, failed, not attempted yet, ..."""
    done = sum(exercise.status == "passed" for exercise in exercises)
    print(f"practice: {done} of {len(exercises)} exercises passed in this kernel")
    for exercise in exercises:
        print(f"  {exercise.status:>17}  {exercise.key}  ({KINDS[exercise.kind]}: {exercise.title})")
