"""`python -m gpukit gpu-check` (`make gpu-check`): verify gpukit on a CUDA GPU with one command.

It runs, each step under its own time limit so that one hang cannot eat the others' time:
1. the tests marked gpu: `pytest -m gpu tests/`;
2. every lesson in notebooks/ under nbval (`--nbval-lax --nbval-current-env`) in the `gpu` profile,
   one pytest per lesson (timed), with a time limit per cell;
3. every `benchmarks/*.py --device cuda --json PATH`;
then appends a dated section to benchmarks/RESULTS.md (GPU, driver, CUDA, torch, Python; each test file's
counts, each lesson's result and time, each benchmark's figures) and prints a one-screen summary.
Logs go to runs/gpu-check/<date-time>/ (ignored by git), and the lessons as they ran, outputs and all, to its
notebooks/: `make site FROM=runs/gpu-check/<date-time>/notebooks` publishes them (gpukit/site.py). Without a
CUDA GPU it says so in one line and exits with EXIT_NO_GPU, running nothing. It imports only the standard
library, torch and (if present) pynvml, so it runs wherever the lessons can.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .env import detect
from .report import format_value
from .runfile import git_commit

# Seconds. Every limit hit at once still ends within 30 minutes on one H100: 180 + 1200 + 360 s = 29 min.
# The lessons' profile cells estimate 1-4 min each on one H100, about 18 min for all ten.
TESTS_SECONDS = 180  # about ten tests are marked gpu; most of this is collecting the suite
LESSONS_SECONDS = 1200  # all lessons together
LESSON_SECONDS = 600  # one lesson: the gpu profile's budget
CELL_SECONDS = 240  # one cell: nbval fails a hung cell by name before its lesson is stopped
BENCHMARKS_SECONDS = 360  # all benchmarks together
BENCHMARK_SECONDS = 180  # one benchmark
MIN_SECONDS = 30  # a lesson or benchmark with less time left than this is not started
STOP_GRACE_SECONDS = 10  # after SIGINT, before SIGKILL: pytest's teardown shuts its Jupyter kernel down
# Sizes the benchmarks' own docstrings give for a GPU, where their defaults are the CPU's.
# input_pipeline: photograph-sized JPEGs, where nvJPEG's fixed cost per call is small (see gk.data.decoding).
BENCHMARK_ARGS = {
    "fit_overhead.py": "--width 64 --batch-size 512 --gpt-width 384 --gpt-depth 6 --rounds 5".split(),
    "input_pipeline.py": "--decode-images 1024 --decode-size 512 --workers 8".split(),
    "peers.py": "--width 64 --batch-size 512 --gpt-width 384 --gpt-depth 6 --rounds 5 --first-step 3".split(),
}
STEP_SECONDS = {"tests": TESTS_SECONDS, "lessons": LESSONS_SECONDS, "benchmarks": BENCHMARKS_SECONDS}
STEPS = tuple(STEP_SECONDS)
EXIT_FAILED = 1  # a step failed or timed out
EXIT_NO_GPU = 3  # nothing was run
EXIT_UNCOLLECTED = 4  # nothing failed, but a test file could not be collected (a module it imports is missing)


@dataclass
class Machine:
    gpus: list[str]  # names, as NVML or nvidia-smi report them
    driver: str
    cuda: str | None  # torch.version.cuda: the CUDA torch was built with
    torch: str
    python: str
    commit: str | None
    date: str  # ISO date, local time

    @property
    def gpu(self) -> str:
        """The GPU's name ("NVIDIA H100 80GB HBM3"), or "2 × NVIDIA H100 80GB HBM3" for several of one kind."""
        counts = Counter(self.gpus)
        return ", ".join(name if count == 1 else f"{count} × {name}" for name, count in counts.items())


@dataclass
class StepResult:
    kind: str  # "tests", "lesson" or "benchmark"
    name: str
    # "pass", "fail", "timeout", "skipped", "not run", "uncollected" (a test file that could not be imported) or
    # "not started" (gpu-check --budget: it would not have finished in what was left)
    status: str
    seconds: float
    detail: str = ""  # counts, the first failure or why it was skipped
    counts: dict[str, Counter] = field(default_factory=dict)  # tests: per test file
    figures: dict | None = None  # benchmarks: what their --json wrote

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "timeout", "not run")  # "not run": its step's time was spent

    @property
    def uncollected(self) -> bool:
        return self.status == "uncollected" or any(counts["uncollected"] for counts in self.counts.values())


# ---------------------------------------------------------------------------------------------
# The machine


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_identity() -> tuple[list[str], str] | None:
    try:
        import pynvml  # nvidia-ml-py, an optional extra: without it, nvidia-smi answers
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [_text(pynvml.nvmlDeviceGetName(h)) for h in handles], _text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_identity() -> tuple[list[str], str] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):  # not installed, no driver, hung
        return None
    rows = [[part.strip() for part in line.split(",")] for line in out.splitlines() if "," in line]
    return ([row[0] for row in rows], rows[0][1]) if rows else None


def gpu_identity() -> tuple[list[str], str] | None:
    """(GPU names, driver version) from NVML, else nvidia-smi; None if neither answers. Never initialises
    CUDA here: the lessons and benchmarks get the whole GPU, not what this process's context leaves."""
    return _nvml_identity() or _nvidia_smi_identity()


def no_gpu_message() -> str | None:
    """One line saying why there is nothing to check here, or None where torch can use a CUDA GPU."""
    if torch.cuda.is_available():
        return None
    cuda = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    build = f"torch {torch.__version__} ({cuda})"
    found, visible = gpu_identity(), os.environ.get("CUDA_VISIBLE_DEVICES")
    if found and found[0]:
        seen = f"gpu-check: driver {found[1]} reports {found[0][0]}, but {build}"
        if visible is not None:  # NVML sees every GPU, whatever this variable hides from CUDA
            return f"{seen} sees no GPU with CUDA_VISIBLE_DEVICES={visible!r}; unset it. Nothing was run."
        return f"{seen} cannot use it: install a torch built for a CUDA this driver supports. Nothing was run."
    return f"gpu-check: no CUDA GPU that {build} can use here; run it on a machine with an NVIDIA GPU. Nothing was run."


def describe_machine(root: Path) -> Machine:
    names, driver = gpu_identity() or ([gpu.name for gpu in detect().gpus], "unknown")
    commit = git_commit(root)
    return Machine(
        names or ["unknown GPU"],
        driver,
        torch.version.cuda,
        torch.__version__,
        platform.python_version(),
        commit and commit[:12],
        datetime.date.today().isoformat(),
    )


# ---------------------------------------------------------------------------------------------
# Running one command under a time limit


def child_environment(root: Path, **variables: str) -> dict[str, str]:
    """This environment, with the checkout first on PYTHONPATH (Jupyter kernels start in notebooks/ and must
    import this gpukit, installed or not) and output unbuffered, so that a log shows where a hang happened."""
    environment = dict(os.environ, PYTHONUNBUFFERED="1", **variables)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), environment.get("PYTHONPATH")]))
    return environment


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """In a command's first process, before it starts (Linux): SIGKILL when the check dies, even by SIGKILL, which
    no handler of the check's can catch (the command runs in a session of its own, out of the check's group)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the check died before prctl: nothing would signal this process
        os._exit(1)


def _stop(process: subprocess.Popen) -> None:
    """SIGINT to the command's process group (pytest tears down and stops its kernel), then SIGKILL.
    A Jupyter kernel has a session of its own, and exits by itself once its parent is gone."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # already gone
            return
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(
    command: list[str], *, cwd: Path, environment: dict, seconds: float, log: Path
) -> tuple[str, int | None, float]:
    """Run `command` with its output in `log` and stop it, with every process it started, after `seconds`.

    Returns (status "pass" | "fail" | "timeout", exit code or None after a timeout, wall seconds)."""
    started = time.perf_counter()
    die_with_us = functools.partial(_die_with_parent, os.getpid()) if _LIBC is not None else None
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops it all
            preexec_fn=die_with_us,
        )
        try:
            code = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            _stop(process)
            return "timeout", None, time.perf_counter() - started
        except KeyboardInterrupt:  # Ctrl-C, or gpu-check --budget's SIGTERM: never leave a process holding the GPU
            _stop(process)
            raise
    return ("pass" if code == 0 else "fail"), code, time.perf_counter() - started


def last_line(log: Path, width: int = 160) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:width] if lines else "(no output)"


# ---------------------------------------------------------------------------------------------
# pytest's JUnit XML: counts per test file, and the first failure


# pytest writes the escape character of terminal colours as "#x1B" in its XML (it is not allowed there).
ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")
EXCEPTION_LINE = re.compile(r"^(?:E\s+)?([\w.]*(?:Error|Exception|Exit|Interrupt|Warning)):(.*)$")
NBVAL_REASON = re.compile(r"^Cell \d+: (.+)$")  # nbval: "Cell 12: Timeout of 240 seconds exceeded executing cell"


def _outcome(case: ElementTree.Element) -> str:
    error = case.find("error")
    if error is not None and not case.get("classname") and error.get("message") == "collection failure":
        return "uncollected"  # pytest's record of a test file it could not import: name "tests.test_site"
    for tag, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return outcome
    return "passed"


def junit_counts(path: Path) -> dict[str, Counter]:
    """{test file ("test_memory"): Counter(passed=…, failed=…, skipped=…, errors=…)} from `pytest --junitxml`;
    {} if pytest wrote no file (it was stopped, or could not start)."""
    if not path.exists():
        return {}
    counts: dict[str, Counter] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        # "tests.test_memory" or "tests.test_memory.TestClass"; a collection error has only a name "tests.test_site"
        parts = (case.get("classname") or case.get("name", "")).split(".")
        group = next((part for part in parts if part.startswith("test_")), ".".join(parts) or "?")
        counts.setdefault(group, Counter())[_outcome(case)] += 1
    return counts


def failure_line(report: str) -> str:
    """The line of a test's failure report that says what went wrong: the last exception with its message
    ("AssertionError: loss did not fall"); for a bare exception, nbval's reason with the exception's name
    ("Timeout of 240 seconds exceeded executing cell (KeyboardInterrupt)"); else the report's first line."""
    lines = [line.strip() for line in ANSI.sub("", report).splitlines() if line.strip()]
    exceptions = [match for line in lines if (match := EXCEPTION_LINE.match(line))]
    if exceptions and exceptions[-1].group(2).strip():
        return f"{exceptions[-1].group(1)}:{exceptions[-1].group(2)}"
    reason = next((match.group(1) for line in lines if (match := NBVAL_REASON.match(line))), None)
    if reason:
        return f"{reason} ({exceptions[-1].group(1)})" if exceptions else reason
    return lines[0] if lines else "failed"


def first_failure(path: Path, width: int = 160) -> str:
    """The first failing test in a JUnit file as "test or cell name: what went wrong", or "" if none failed."""
    if not path.exists():
        return ""
    for case in ElementTree.parse(path).iter("testcase"):
        for problem in (*case.iter("failure"), *case.iter("error")):
            return f"{case.get('name')}: {failure_line(problem.text or problem.get('message', ''))}"[:width]
    return ""


def describe_counts(counts: Counter) -> str:
    order = ("passed", "failed", "errors", "skipped", "uncollected")
    return ", ".join(f"{counts[key]} {key}" for key in order if counts[key]) or "nothing ran"


# ---------------------------------------------------------------------------------------------
# The three steps


def tests_status(status: str, code: int | None, total: Counter) -> str:
    """ "uncollected" where pytest failed only because a test file could not be imported; else `status`."""
    if status == "fail" and total["uncollected"] and not (total["failed"] or total["errors"]):
        return "uncollected"
    return status


def run_tests(root: Path, logs: Path, seconds: float = TESTS_SECONDS, files: list[str] | None = None) -> StepResult:
    """`pytest -m gpu tests/` (or only `files`, paths from the root), with the counts of each test file."""
    name = "-m gpu" if files is None else " ".join(Path(file).stem for file in files)
    junit = logs / f"tests{'' if files is None else '-' + name.replace(' ', '-')}.xml"
    log = junit.with_suffix(".log")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        *(files or ["tests/"]),
        "-q",
        "-p",
        "no:cacheprovider",
        # A test file that cannot be imported (jupyter_server missing, say) is counted as an error, and the
        # gpu tests of every other file still run: one such file stopped the whole step on an H100.
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
        "-o",
        f"timeout={min(120, int(seconds))}",
    ]
    status, code, elapsed = run_command(
        command, cwd=root, environment=child_environment(root), seconds=seconds, log=log
    )
    counts = junit_counts(junit)
    total = sum(counts.values(), Counter())
    status = tests_status(status, code, total)
    if status == "timeout":
        detail = f"stopped after {seconds:.0f} s; {describe_counts(total)}"
    elif code == 5:  # pytest: no tests collected
        status, detail = "fail", "no tests marked gpu were collected"
    else:
        detail = describe_counts(total) if counts else last_line(log)
        if status in ("fail", "uncollected") and counts:
            detail += f"; first: {first_failure(junit)}"
    return StepResult("tests", name, status, elapsed, detail, counts)


def _time_left(deadline: float, limit: float) -> float:
    return min(limit, deadline - time.monotonic())


def chosen(paths, only: list[str] | None) -> list[Path]:
    """`paths` whose name starts with one of `only` (all where None), in `only`'s order: the first named run first."""
    paths = sorted(paths)
    return paths if only is None else [path for prefix in only for path in paths if path.name.startswith(prefix)]


def lesson_command(notebook: Path, junit: Path, keep: Path, cell_seconds: int, seconds: int) -> list[str]:
    """pytest running one lesson under nbval as make test does (`--nbval-lax --nbval-current-env`): a cell failed by
    nbval after `cell_seconds` and stopped by pytest-timeout after `seconds`, the cells' results in the JUnit file
    `junit`, and the lesson with its outputs kept in the folder `keep` (for the site: make site FROM=<keep>)."""
    return [
        sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", str(notebook),
        f"--nbval-cell-timeout={cell_seconds}", "-o", f"timeout={seconds}", "-q", "-p", "no:cacheprovider",
        f"--junitxml={junit}", "-p", "gpukit.nbval_outputs", f"--nbval-keep-outputs={keep}",
    ]  # fmt: skip


def lessons_cannot_run(root: Path, logs: Path) -> StepResult | None:
    """One clear failure, not ten alike, where nbval or the kernel cannot even be imported (a missing wheel)."""
    command = [sys.executable, "-c", "import nbval.plugin, ipykernel.kernelapp"]
    environment = child_environment(root, GPUKIT_PROFILE="gpu")
    log = logs / "lessons-imports.log"
    status, _, elapsed = run_command(command, cwd=root, environment=environment, seconds=120, log=log)
    if status == "pass":
        return None
    return StepResult("lesson", "(all)", "fail", elapsed, f"nbval or ipykernel does not import: {last_line(log)}")


def run_lesson(root: Path, logs: Path, notebook: Path, limit: float) -> StepResult:
    """One lesson under nbval in the gpu profile, in its own pytest and kernel, stopped after `limit` seconds."""
    name, junit = notebook.stem, logs / f"{notebook.stem}.xml"
    command = lesson_command(notebook, junit, logs / "notebooks", min(CELL_SECONDS, int(limit)), int(limit))
    environment = child_environment(root, GPUKIT_PROFILE="gpu")
    status, _, elapsed = run_command(
        command, cwd=root, environment=environment, seconds=limit, log=logs / f"{name}.log"
    )
    cells = sum(junit_counts(junit).values(), Counter())
    if status == "timeout":  # nbval may have failed a cell by its own timeout before we stopped it
        detail = "; ".join(filter(None, [f"stopped after {limit:.0f} s", first_failure(junit)]))
    elif status == "fail":
        detail = first_failure(junit) or last_line(logs / f"{name}.log")
    else:
        detail = f"cells: {describe_counts(cells)}"
    return StepResult("lesson", name, status, elapsed, detail)


def run_lessons(
    root: Path, logs: Path, seconds: float = LESSONS_SECONDS, *, only=None, report=print
) -> list[StepResult]:
    """Each lesson under nbval in the gpu profile, one pytest (and one kernel) per lesson, timed."""
    deadline = time.monotonic() + seconds
    problem = lessons_cannot_run(root, logs)
    if problem:
        report(summary_row(problem))
        return [problem]
    results = []
    for notebook in chosen((root / "notebooks").glob("[0-9][0-9]*_*.ipynb"), only):
        name, limit = notebook.stem, _time_left(deadline, LESSON_SECONDS)
        if limit < MIN_SECONDS:
            results.append(StepResult("lesson", name, "not run", 0.0, f"the lessons' {seconds:.0f} s were spent"))
            report(summary_row(results[-1]))
            continue
        results.append(run_lesson(root, logs, notebook, limit))
        report(summary_row(results[-1]))
    return results


def _benchmark_result(
    name: str, status: str, elapsed: float, limit: float, figures_path: Path, log: Path
) -> StepResult:
    if status == "timeout":
        return StepResult("benchmark", name, status, elapsed, f"stopped after {limit:.0f} s")
    if status == "fail":
        return StepResult("benchmark", name, status, elapsed, last_line(log))
    if not figures_path.exists():
        return StepResult("benchmark", name, "fail", elapsed, "exited 0 but wrote no --json figures")
    figures = json.loads(figures_path.read_text())
    if figures.get("skipped"):
        return StepResult("benchmark", name, "skipped", elapsed, figures["skipped"], figures=figures)
    tables = figures.get("tables", [])
    detail = f"{len(tables)} table(s), {sum(len(t['rows']) for t in tables)} rows"
    return StepResult("benchmark", name, "pass", elapsed, detail, figures=figures)


def benchmark_command(script: Path, figures_path: Path) -> list[str]:
    return [
        sys.executable,
        str(script),
        "--device",
        "cuda",
        "--json",
        str(figures_path),
        *BENCHMARK_ARGS.get(script.name, []),
    ]


def run_benchmark(root: Path, logs: Path, script: Path, limit: float) -> StepResult:
    """`script --device cuda --json …`, stopped after `limit` seconds, its figures read back."""
    figures_path, log = logs / f"{script.stem}.json", logs / f"{script.stem}.log"
    command, environment = benchmark_command(script, figures_path), child_environment(root)
    status, _, elapsed = run_command(command, cwd=root, environment=environment, seconds=limit, log=log)
    return _benchmark_result(script.stem, status, elapsed, limit, figures_path, log)


def run_benchmarks(
    root: Path, logs: Path, seconds: float = BENCHMARKS_SECONDS, *, only=None, report=print
) -> list[StepResult]:
    """Every benchmarks/*.py with --device cuda, its figures read back from its --json file."""
    deadline = time.monotonic() + seconds
    results = []
    for script in chosen((root / "benchmarks").glob("*.py"), only):
        name, limit = script.stem, _time_left(deadline, BENCHMARK_SECONDS)
        if limit < MIN_SECONDS:
            results.append(StepResult("benchmark", name, "not run", 0.0, f"the benchmarks' {seconds:.0f} s were spent"))
        else:
            results.append(run_benchmark(root, logs, script, limit))
        report(summary_row(results[-1]))
    return results


# ---------------------------------------------------------------------------------------------
# benchmarks/RESULTS.md and the summary


def _cell(value) -> str:
    return format_value(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def _tests_markdown(result: StepResult) -> list[str]:
    lines = [f"### Tests marked gpu (`pytest -m gpu tests/`): {result.status}, {_minutes(result.seconds)}", ""]
    keys = ("passed", "failed", "errors", "skipped")
    rows = [{"test file": group, **{k: counts[k] for k in keys}} for group, counts in sorted(result.counts.items())]
    if rows:
        total = sum(result.counts.values(), Counter())
        lines += markdown_table(["test file", *keys], [*rows, {"test file": "all", **{k: total[k] for k in keys}}])
        lines.append("")
    return lines + ([f"{result.detail}", ""] if result.status != "pass" else [])


def _lessons_markdown(results: list[StepResult]) -> list[str]:
    lines = [
        f"### Lessons in the `gpu` profile (nbval `--nbval-lax`, at most {CELL_SECONDS} s per cell, "
        f"{LESSON_SECONDS} s per lesson)",
        "",
    ]
    rows = [
        {"lesson": r.name, "result": r.status, "seconds": round(r.seconds), "cells, or the first failure": r.detail}
        for r in results
    ]
    return lines + markdown_table(["lesson", "result", "seconds", "cells, or the first failure"], rows) + [""]


def _benchmark_markdown(result: StepResult) -> list[str]:
    lines = [f"#### `{result.name}.py`: {result.status}, {_minutes(result.seconds)}", ""]
    figures = result.figures or {}
    if result.status != "pass":
        return lines + [result.detail, ""]
    other = {key: value for key, value in figures.items() if key != "tables"}
    if other:
        lines += ["; ".join(f"{key}: {_cell(value)}" for key, value in other.items()), ""]
    for table in figures.get("tables", []):
        lines += ([f"**{table['title']}**", ""] if table.get("title") else []) + markdown_table(
            table["columns"], table["rows"]
        )
        lines.append("")
    return lines


def results_section(
    machine: Machine, results: list[StepResult], seconds: float, command: str = "make gpu-check"
) -> str:
    """The Markdown section for benchmarks/RESULTS.md, headed with the GPU's name and the date."""
    lines = [f"## GPU: {machine.gpu}, {machine.date} (`{command}`)", ""]
    facts = {
        "GPU": machine.gpu,
        "driver": machine.driver,
        "CUDA (torch's build)": machine.cuda,
        "torch": machine.torch,
        "Python": machine.python,
        "commit": machine.commit,
        "the check took": _minutes(seconds),
    }
    lines += markdown_table(list(facts), [facts]) + [""]
    failed, uncollected = failed_and_uncollected(results)
    lines += [f"Failed: {', '.join(failed)}." if failed else "Everything that ran passed.", ""]
    lines += [f"Could not be collected (a module they import is missing): {', '.join(uncollected)}.", ""] * bool(
        uncollected
    )
    lines += [line for r in results if r.kind == "tests" for line in _tests_markdown(r)]
    lessons = [r for r in results if r.kind == "lesson"]
    lines += _lessons_markdown(lessons) if lessons else []
    benchmarks = [r for r in results if r.kind == "benchmark"]
    if benchmarks:
        lines += ["### Benchmarks (`python benchmarks/NAME.py --device cuda`)", ""]
        lines += [line for r in benchmarks for line in _benchmark_markdown(r)]
    return "\n".join(lines).rstrip() + "\n"


def append_section(path: Path, section: str) -> None:
    """Add `section` at the end of `path` (created with a title if missing), keeping what it holds."""
    before = path.read_text() if path.exists() else "# Measured results\n"
    path.write_text(before.rstrip("\n") + "\n\n" + section)


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def summary_row(result: StepResult, width: int = 120) -> str:
    label = f"{result.kind} {result.name}"
    return _shorten(f"{label:<42} {result.status:<8}{result.seconds:>5.0f} s  {result.detail}", width)


def failed_and_uncollected(results: list[StepResult]) -> tuple[list[str], list[str]]:
    """What failed (a test, lesson or benchmark ran and went wrong), and apart from it the test files that could
    not be collected (a module they import is missing: the machine's packages are at fault, not what they test)."""
    failed = [f"{r.kind} {r.name}" for r in results if r.failed]
    uncollected = sorted({group for r in results for group, c in r.counts.items() if c["uncollected"]})
    return failed, uncollected + [f"{r.kind} {r.name}" for r in results if r.status == "uncollected" and not r.counts]


def verdict(results: list[StepResult]) -> str:
    failed, uncollected = failed_and_uncollected(results)
    parts = [f"FAILED {len(failed)} of {len(results)}: {', '.join(failed)}"] if failed else []
    parts += [f"NOT COLLECTED: {', '.join(uncollected)}"] if uncollected else []
    return "; ".join(parts) or "all passed or skipped"


def exit_code(results: list[StepResult]) -> int:
    if any(r.failed for r in results):
        return EXIT_FAILED
    return EXIT_UNCOLLECTED if any(r.uncollected for r in results) else 0


def summary(machine: Machine, results: list[StepResult], seconds: float, results_path: Path | None, logs: Path) -> str:
    """len(results) + 4 lines: the machine, a line per test step, lesson and benchmark, the verdict, where to look."""
    lines = [
        f"gpu-check on {machine.gpu}: driver {machine.driver}, CUDA {machine.cuda}, torch {machine.torch}, "
        f"Python {machine.python}"
    ]
    lines += [summary_row(result) for result in results]
    lines.append(_shorten(f"{_minutes(seconds)} in all; {verdict(results)}", 160))
    lines += [f"section added to {results_path}"] if results_path else []
    lines.append(f"logs in {logs}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command


def repository_root() -> Path:
    """The checkout this gpukit comes from: the check needs its tests/, notebooks/ and benchmarks/."""
    root = Path(__file__).resolve().parents[1]
    missing = [name for name in ("tests", "notebooks", "benchmarks") if not (root / name).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"gpu-check runs the tests, lessons and benchmarks of a gpukit checkout, and {root} has no "
            f"{', '.join(missing)}: run it from a clone (put the clone first on PYTHONPATH, or `pip install -e .`)."
        )
    return root


def run_gpu_check(
    steps=STEPS,
    results_path: Path | None = None,
    log_dir: Path | None = None,
    *,
    only: list[str] | None = None,
    seconds: float | None = None,
) -> int:
    """Run `steps` (some of STEPS, in that order), append the section to `results_path` (default
    benchmarks/RESULTS.md) and print the summary. `only`: the lessons and benchmarks to run, by the start of
    their names, in that order; `seconds`: the whole check's time limit (a lease shorter than 29 minutes), each
    step still within its own. Returns 0, EXIT_FAILED if anything failed, or EXIT_NO_GPU (after one line, having
    run nothing) where torch sees no CUDA GPU."""
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise ValueError(f"unknown gpu-check step(s) {', '.join(sorted(unknown))}; choose from {', '.join(STEPS)}.")
    if only is not None:  # named wrong: said before anything runs, GPU or not
        root = repository_root()
        names = [p.name for p in [*root.glob("notebooks/[0-9][0-9]*_*.ipynb"), *root.glob("benchmarks/*.py")]]
        names += [p.name for p in root.glob("tests/test_*.py")]
        unmatched = [prefix for prefix in only if not any(name.startswith(prefix) for name in names)]
        if unmatched:
            raise ValueError(f"gpu-check --only: {', '.join(unmatched)} names no test file, lesson or benchmark.")
    message = no_gpu_message()
    if message:
        print(message, file=sys.stderr)
        return EXIT_NO_GPU
    root = repository_root()
    results_path = results_path or root / "benchmarks" / "RESULTS.md"
    logs = log_dir or root / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(root)
    print(f"gpu-check on {machine.gpu} (driver {machine.driver}); logs in {logs}", flush=True)
    started, results = time.monotonic(), []
    report = functools.partial(print, flush=True)  # a line as each lesson or benchmark ends
    deadline = started + (seconds if seconds is not None else float("inf"))
    for step in steps:
        limit = _time_left(deadline, STEP_SECONDS[step])
        if step == "tests":
            test_files = [
                path.relative_to(root).as_posix() for path in chosen(root.glob("tests/test_*.py"), only or [])
            ]
            results.append(run_tests(root, logs, limit, *([test_files] if test_files else [])))
            report(summary_row(results[-1]))
        elif step == "lessons":
            results += run_lessons(root, logs, limit, only=only, report=report)
        else:
            results += run_benchmarks(root, logs, limit, only=only, report=report)
    seconds = time.monotonic() - started
    append_section(results_path, results_section(machine, results, seconds))
    print("\n" + summary(machine, results, seconds, results_path, logs))
    return exit_code(results)
