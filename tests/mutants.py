"""Lesson mutation testing: does a lesson's check fail when the gpukit measurement it rests on is wrong?

A *mutant* (tests/mutations.py) runs a lesson with one of gpukit's measurements made wrong by a known factor
(matmul_tflops ×2, timeit ×2, the saved activations ×1.5, …), and its inverse by the other (×0.5, ×0.67): a check
bounded on one side only survives one of the two directions, "up" (the number made larger) or "down". It is *killed* when a check cell of the lesson (a
cell with an `assert`) fails with an AssertionError; it *survives* when the lesson passes: its claims did not
notice. A tautology (a value checked against itself) survives by construction: both sides move together.
Another exception is *crashed*: neither a clean kill nor a survival, reported apart. A mutant whose function the
lesson never calls, or whose change changes nothing there (bf16 reported where it already is), is *not
applicable*. The score is the killed share of the applicable runs.

    python -m tests.mutants --lessons 00 --mutants matmul_tflops_x2 timeit      # a family: both directions
    python -m tests.mutants --lessons 00 --direction down                      # every inverse mutant
    python -m tests.mutants --list                                             # each mutant and what it changes
    make mutants MUTANTS_ARGS="--lessons 00 --mutants matmul_tflops_x2"

Each run is a fresh Jupyter kernel (nbclient) with GPUKIT_PROFILE (tiny unless --profile), stopped at the first
failing cell. The kernel starts with tests/mutant_startup first on PYTHONPATH: its sitecustomize.py applies the
mutant named in GPUKIT_MUTANT before the lesson's first cell, and notes calls in the file GPUKIT_MUTANT_CALLS
names; gpukit itself carries no mutation code. Each lesson first runs unmutated with every target wrapped to
record its calls: a lesson that fails so makes its mutants' outcomes meaningless (all "baseline failed"), and a
mutant whose function that run never called is not applicable without running again (--no-baseline runs each).
The table has a row per mutant, its two directions one under the other, and the load average (1 min) of the machine
at the start and end of the whole run and, per lesson, over its runs: timing checks are read against it.
Exit status 1 where a mutant survived that KNOWN_SURVIVORS does not explain, a run crashed or a baseline failed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpukit import site
from gpukit.site import is_check
from tests.mutations import DIRECTIONS, KNOWN_SURVIVORS, MUTANTS, RECORD, Calls

ROOT = Path(__file__).resolve().parent.parent
STARTUP = Path(__file__).resolve().parent / "mutant_startup"  # its sitecustomize.py applies the mutant
LESSONS = ROOT / "notebooks"
CELL_SECONDS = 600
KILLED, SURVIVED, KNOWN, CRASHED, NOT_APPLICABLE, BASELINE_FAILED = (
    "killed",
    "survived",
    "survived (known)",
    "crashed",
    "n/a",
    "baseline failed",
)


@dataclass
class Run:
    """How one lesson ran with one mutant (or none: RECORD)."""

    lesson: str  # the notebook's stem
    mutant: str
    outcome: str  # one of the outcomes above ("passed" for a baseline that passed)
    detail: str = ""  # where it was killed or crashed: "cell 12: AssertionError: …"
    seconds: float = 0.0
    calls: Calls | None = None
    load: tuple[float, float] | None = None  # the machine's 1-minute load average at the run's start and end


def load_average() -> float:
    """The machine's load average over the last minute: processes running or waiting for a core."""
    return os.getloadavg()[0]


def first_error(notebook) -> tuple[int, str, str, bool] | None:
    """(cell index, exception name, its message, whether the cell is a check) of the first cell with an error."""
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                return index, output.ename, output.evalue, is_check(cell.source)
    return None


def execute(path: Path, variables: dict[str, str], cell_seconds: float) -> tuple[object, str]:
    """`path` run in a fresh kernel of this Python with `variables` set, stopped at the first error (as make site
    runs a lesson). Returns the executed notebook and why it stopped early where no cell says so (a timeout, a dead
    kernel), else ""."""
    notebook = site.execute(path, cell_seconds=cell_seconds, variables=variables)
    return notebook, notebook.metadata[site.METADATA_KEY].get("stopped", "")


def classify(notebook, stopped: str, mutant: str, calls: Calls) -> tuple[str, str]:
    """(outcome, detail) of a run of `mutant` (RECORD: the baseline, "passed" or BASELINE_FAILED)."""
    error = first_error(notebook)
    detail = f"cell {error[0]}: {error[1]}: {' '.join(error[2].split())[:100]}" if error else stopped
    if mutant == RECORD:
        return (BASELINE_FAILED if error or stopped else "passed"), detail
    if mutant not in calls.applied:
        return CRASHED, f"the mutant was not applied in the kernel (tests/mutant_startup failed) {detail}".strip()
    if not error and not stopped:
        return (SURVIVED if mutant in calls.changed else NOT_APPLICABLE), ""
    if mutant not in calls.changed:
        return CRASHED, f"{detail} (the mutant changed nothing: the lesson failed by itself)"
    # A check cell's assert, or gk.check's CheckFailed (an AssertionError, named as its own class in the output).
    killed = error and error[1] in ("AssertionError", "CheckFailed") and error[3]
    return (KILLED if killed else CRASHED), detail


def run_one(path: Path, mutant: str, profile: str, cell_seconds: float = CELL_SECONDS) -> Run:
    """Run the lesson at `path` with `mutant` (or RECORD) in a fresh kernel, and say how it went."""
    with tempfile.TemporaryDirectory(prefix="gpukit-mutant-") as folder:
        log = Path(folder) / "calls.txt"
        variables = {
            "GPUKIT_MUTANT": mutant,
            "GPUKIT_MUTANT_CALLS": str(log),
            "GPUKIT_PROFILE": profile,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(STARTUP), os.environ.get("PYTHONPATH")])),
        }
        started, load = time.perf_counter(), load_average()
        notebook, stopped = execute(path, variables, cell_seconds)
        calls = Calls.read(log)
    outcome, detail = classify(notebook, stopped, mutant, calls)
    return Run(path.stem, mutant, outcome, detail, time.perf_counter() - started, calls, (load, load_average()))


def machine_kind() -> str:
    """The kind KNOWN_SURVIVORS is keyed by: "cuda" where the lessons see a CUDA GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def lesson_number(lesson: str) -> str:
    return lesson.split("_", 1)[0]


def run_lesson(
    path: Path,
    mutants: Sequence[str],
    profile: str,
    *,
    baseline: bool = True,
    runner: Callable[[Path, str, str], Run] = run_one,
    report: Callable[[Run], None] = lambda run: None,
) -> list[Run]:
    """One Run per mutant of the lesson at `path` (`runner` runs one; `report` hears each as it ends). With
    `baseline`, the lesson first runs unmutated recording its calls: if it fails, no mutant runs (all
    BASELINE_FAILED); a mutant whose target it never called is NOT_APPLICABLE without a run."""
    called = None
    if baseline:
        first = runner(path, RECORD, profile)
        report(first)
        if first.outcome != "passed":
            return [Run(path.stem, name, BASELINE_FAILED, first.detail) for name in mutants]
        called = first.calls.called
    runs = []
    for name in mutants:
        if called is not None and MUTANTS[name].target not in called:
            run = Run(path.stem, name, NOT_APPLICABLE, "its function was not called unmutated")
        else:
            run = runner(path, name, profile)
            if run.outcome == SURVIVED and (lesson_number(path.stem), name, machine_kind()) in KNOWN_SURVIVORS:
                run.outcome = KNOWN
        report(run)
        runs.append(run)
    return runs


def find_lessons(chosen: Sequence[str] | None) -> list[Path]:
    """The lessons numbered one of `chosen` ("06", "06b"), else whose name starts with it ("0", "03_memory"), or
    notebook paths; all by default."""
    lessons = sorted(LESSONS.glob("[0-9][0-9]*_*.ipynb"))
    if not chosen:
        return lessons
    found = []
    for choice in chosen:
        if choice.endswith(".ipynb"):
            matches = [Path(choice).resolve()] if Path(choice).is_file() else []
        else:
            numbered = [path for path in lessons if lesson_number(path.stem) == choice]  # "06": not "06b_…" too
            matches = numbered or [path for path in lessons if path.stem.startswith(choice)]
        if not matches:
            raise SystemExit(f"--lessons {choice}: no lesson in {LESSONS} starts so, and no such notebook file.")
        found += [path for path in matches if path not in found]
    return found


MARKS = {
    KILLED: "killed",
    SURVIVED: "SURVIVED",
    KNOWN: "survived*",
    CRASHED: "CRASHED",
    NOT_APPLICABLE: "n/a",
    BASELINE_FAILED: "BASELINE FAILED",
}


def _row_order(name: str) -> tuple[int, int]:
    """A mutant's place in the table: its family where MUTANTS first has it, then up before down."""
    families = list(dict.fromkeys(mutant.family for mutant in MUTANTS.values()))
    return families.index(MUTANTS[name].family), DIRECTIONS.index(MUTANTS[name].direction)


def _load_range(runs: Sequence[Run]) -> str:
    loads = [value for run in runs if run.load for value in run.load]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def _grid(runs: Sequence[Run]) -> list[str]:
    """A row per mutant (its family named once, then "up ×2", "down ×0.5"), a column per lesson, and a last row of
    the load average (1 min) over each lesson's runs."""
    lessons = list(dict.fromkeys(run.lesson for run in runs))
    outcome = {(run.lesson, run.mutant): run.outcome for run in runs}
    width = max([len("load (1 min)")] + [len(MUTANTS[run.mutant].family) for run in runs])

    def row(first: str, direction: str, cells: list[str]) -> str:
        return f"{first:<{width}}  {direction:<10}  " + "  ".join(f"{cell:<16}" for cell in cells).rstrip()

    lines = [row("mutant", "direction", [lesson_number(lesson) for lesson in lessons])]
    shown = None
    for name in sorted(dict.fromkeys(run.mutant for run in runs), key=_row_order):
        mutant = MUTANTS[name]
        direction = mutant.direction + (f" ×{name.rpartition('_x')[2]}" if mutant.factor else "")
        cells = [MARKS.get(outcome.get((lesson, name)), "-") for lesson in lessons]
        lines.append(row(mutant.family if mutant.family != shown else "", direction, cells))
        shown = mutant.family
    loads = [_load_range([run for run in runs if run.lesson == lesson]) for lesson in lessons]
    return lines + [row("load (1 min)", "", loads)]


def table(runs: Sequence[Run], load: tuple[float, float] | None = None) -> str:
    """Mutant × lesson (_grid), then the score of each direction and of all, then each kill, crash and survival
    explained. `load`: the machine's 1-minute load average at the start and end of the whole run."""
    lines = [f"load average (1 min): {load[0]:.1f} at the start, {load[1]:.1f} at the end"] if load else []
    lines += _grid(runs) + [""]
    by_direction = {way: [run for run in runs if MUTANTS[run.mutant].direction == way] for way in DIRECTIONS}
    if all(by_direction.values()):  # both directions ran: a score for each, then for all
        lines += [score_line(chosen, f" ({way})") for way, chosen in by_direction.items()]
    lines += [score_line(runs), ""]
    for run in runs:
        if run.outcome == KNOWN:
            known = KNOWN_SURVIVORS[(lesson_number(run.lesson), run.mutant, machine_kind())]
            lines.append(f"{run.lesson} × {run.mutant}: {run.outcome}: {known.why}; killed by {known.killed_by}")
        elif run.outcome != NOT_APPLICABLE and run.detail:
            lines.append(f"{run.lesson} × {run.mutant}: {run.outcome}: {run.detail}")
    return "\n".join(lines)


def score_line(runs: Sequence[Run], which: str = "") -> str:
    counts = {outcome: sum(run.outcome == outcome for run in runs) for outcome in MARKS}
    applicable = counts[KILLED] + counts[SURVIVED] + counts[KNOWN] + counts[CRASHED]
    share = f"{100 * counts[KILLED] / applicable:.0f}%" if applicable else "no applicable run"
    return (
        f"score{which}: {counts[KILLED]} killed of {applicable} applicable ({share}); {counts[SURVIVED]} survived, "
        f"{counts[KNOWN]} survived as known (*), {counts[CRASHED]} crashed, {counts[NOT_APPLICABLE]} not applicable"
        + (f", {counts[BASELINE_FAILED]} not run: the lesson failed unmutated" if counts[BASELINE_FAILED] else "")
    )


def failed(runs: Sequence[Run]) -> bool:
    return any(run.outcome in (SURVIVED, CRASHED, BASELINE_FAILED) for run in runs)


def chosen_mutants(names: Sequence[str] | None, direction: str) -> list[str]:
    """The mutants `names` (mutant or family names; all by default) in `direction` ("up", "down" or "both"),
    in MUTANTS' order. Raises ValueError naming any unknown name."""
    families = {mutant.family for mutant in MUTANTS.values()}
    unknown = [name for name in names or [] if name not in MUTANTS and name not in families]
    if unknown:
        raise ValueError(
            f"unknown mutants {', '.join(unknown)}; choose mutants or families from --list "
            f"(e.g. timeit_x2, or timeit for both directions)."
        )
    wanted = set(names or MUTANTS)
    return [
        mutant.name
        for mutant in MUTANTS.values()
        if (mutant.name in wanted or mutant.family in wanted) and direction in ("both", mutant.direction)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lessons", nargs="*", help="lesson numbers or name prefixes (00 03_memory), or .ipynb paths")
    parser.add_argument("--mutants", nargs="*", help="mutant names (timeit_x2) or families (timeit); default all")
    parser.add_argument("--direction", choices=[*DIRECTIONS, "both"], default="both", help="up, down or both (default)")
    parser.add_argument("--profile", default="tiny", help="GPUKIT_PROFILE of the runs (default tiny)")
    parser.add_argument("--no-baseline", action="store_true", help="run every mutant, without the unmutated run")
    parser.add_argument("--list", action="store_true", help="print each mutant, its direction and what it changes")
    options = parser.parse_args(argv)
    try:
        mutants = chosen_mutants(options.mutants, options.direction)
    except ValueError as error:
        parser.error(str(error))
    if options.list:
        for name in mutants:
            print(f"{name:<28} {MUTANTS[name].direction:<5} {MUTANTS[name].what}")
        return 0
    lessons = find_lessons(options.lessons)
    start_load = load_average()
    print(
        f"{len(lessons)} lessons × {len(mutants)} mutants, profile {options.profile}, on {machine_kind()}, "
        f"started {datetime.datetime.now():%Y-%m-%d %H:%M} at load average {start_load:.1f} (1 min)",
        flush=True,
    )

    def report(run: Run) -> None:
        load = f", load {run.load[0]:.1f}-{run.load[1]:.1f}" if run.load else ""
        print(f"  {run.lesson} × {run.mutant}: {run.outcome} ({run.seconds:.0f} s{load}) {run.detail}", flush=True)

    runs = []
    for path in lessons:
        runs += run_lesson(path, mutants, options.profile, baseline=not options.no_baseline, report=report)
    print("\n" + table(runs, load=(start_load, load_average())))
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
