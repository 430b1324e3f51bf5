"""`make site` (`gpukit site DIR`): every lesson executed, published as a static site of plain HTML files.

Each lesson runs top to bottom in a fresh Jupyter kernel (nbclient), in its notebook's folder as nbval runs it, in
the profile gpukit chooses for the machine (tiny in CI or on two cores, gpu with a CUDA GPU) or the one asked for.
`--from DIR` publishes notebooks executed before instead, running nothing: `make gpu-check` keeps the lessons it
ran in runs/gpu-check/DATE-TIME/notebooks/. nbconvert turns each lesson into one self-contained page (figures
embedded, no script, stylesheet or image loaded from elsewhere, so it reads offline: the lessons' Open in Colab and
Kaggle badges become plain links), with a pill under each check cell (one that calls `gk.check`, `gk.check_between`
or `gk.skip_check`, or holds an `assert`): passed, failed, not run, or skipped here where every check it holds
printed "skipped" (a GPU-only claim on a CPU), and how many ran where only some did. A cell whose code is hidden in
JupyterLab (its metadata `jupyter.source_hidden`, as the lessons' check cells are) shows its code folded under
"check (code hidden)", its output in full. index.html lists every lesson with its profile, device, run date, time,
checks passed and skipped, and figures.

The build fails, naming the lesson and the cell, where a lesson raised an error, left a cell unrun or showed no
figure: CI publishes nothing rather than a broken lesson. Why nbconvert and not Jupyter Book or mkdocs-jupyter:
docs/site.md.
"""

from __future__ import annotations

import ast
import datetime
import re
import time
from pathlib import Path

import ipykernel.kernelspec
import nbformat
import zmq
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from ..runfile import git_commit
from ..shipped import folder
from .gpucheck import child_environment
from .site_pages import (  # noqa: F401 (the pages' names, importable from here as before)
    STYLE,
    TEMPLATE,
    WIDGET_TYPE,
    Check,
    Lesson,
    exercise_key,
    render_index,
    render_lesson,
    solution_code,
    without_remote_images,
)

LESSON_GLOB = "[0-9][0-9]*_*.ipynb"
CELL_SECONDS = 600  # one cell; the tiny profile runs a whole lesson in 30-200 s on two busy cores
METADATA_KEY = "gpukit"  # the notebook's metadata that says when it ran: {"executed": ISO time, "seconds": …}
FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
# The setup cell of every lesson prints the Env: "device=cuda gpus=1 (NVIDIA H100 80GB HBM3) bf16=True … profile=gpu (…)"
ENV_LINE = re.compile(r"^device=(?P<device>\S+) gpus=\d+ \((?P<gpus>.*)\) bf16=.* profile=(?P<profile>\w+)", re.M)
# The lines gk.check / gk.check_between and gk.skip_check print (gpukit/claims.py): one per check.
SKIPPED_LINE = re.compile(r"^skipped\b", re.M | re.I)  # a check this machine cannot make, e.g. a GPU-only claim
PASSED_LINE = re.compile(r"^check passed\b", re.M | re.I)
UNATTEMPTED_LINE = re.compile(r"^not attempted yet\b", re.M | re.I)  # an exercise shipped blank (gpukit/practice)


# ---------------------------------------------------------------------------------------------
# Running a lesson


class ThisPython(KernelSpecManager):
    """Every kernel name means this Python, as nbval's --nbval-current-env does: the lessons run with the packages
    the builder has, whatever kernels are installed elsewhere on the machine."""

    def get_kernel_spec(self, kernel_name):
        return self.kernel_spec_class(
            resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict()
        )


def execute(
    path: Path, profile: str | None = None, cell_seconds: float = CELL_SECONDS, variables: dict[str, str] | None = None
):
    """The lesson at `path` executed top to bottom in a new kernel of this Python, stopping at the first error.

    The kernel starts in the lesson's folder (as under nbval), imports this gpukit (its folder first on
    PYTHONPATH), plots inline (MPLBACKEND is dropped: Agg would show no figure) and runs with
    GPUKIT_PROFILE=`profile` if given, and the environment `variables`. An error, a cell over `cell_seconds` (interrupted: its traceback says
    where) or a dead kernel is left in the notebook for `describe` to report. The kernel is shut down when the
    lesson ends, however it ends."""
    notebook = nbformat.read(path, as_version=4)
    variables = {**(variables or {}), **({"GPUKIT_PROFILE": profile} if profile else {})}
    environment = child_environment(Path(__file__).resolve().parents[2], **variables)
    environment.pop("MPLBACKEND", None)
    kernel = KernelManager(kernel_spec_manager=ThisPython())
    encrypt(kernel)
    client = NotebookClient(
        notebook,
        km=kernel,
        timeout=cell_seconds,
        interrupt_on_timeout=True,
        resources={"metadata": {"path": str(path.parent)}},
    )
    started, executed = time.perf_counter(), datetime.datetime.now().isoformat(timespec="seconds")
    stopped = None
    try:
        client.execute(env=environment)
    except CellExecutionError:
        pass  # the cell holds the error's output
    except (CellTimeoutError, DeadKernelError) as error:  # the cell may hold no output that says so
        stopped = " ".join(str(error).split())[:300]
    finally:
        shut_down(client, kernel)
    notebook.metadata[METADATA_KEY] = {"executed": executed, "seconds": round(time.perf_counter() - started, 1)}
    if stopped:
        notebook.metadata[METADATA_KEY]["stopped"] = stopped
    return notebook


def encrypt(kernel: KernelManager) -> None:
    """CurveZMQ keys for the lesson's kernel, where jupyter_client can provision them (8.10 and newer) and pyzmq has
    CurveZMQ: its messages (code and outputs) are encrypted, and ipykernel does not print "Kernel is running over TCP
    without encryption" once per lesson. Elsewhere the kernel runs as before (older ipykernels do not warn)."""
    if "transport_encryption" in kernel.trait_names() and zmq.has("curve"):
        kernel.transport_encryption = "required"


def shut_down(client: NotebookClient, kernel: KernelManager) -> None:
    """Close the client's channels and stop the lesson's kernel. nbclient shuts down only a kernel manager it
    created itself (its `owns_km`); `execute` gives it one of its own (to run this Python), so without this every
    lesson's kernel, and what it holds (GPU memory, worker processes), would live until the whole build ends."""
    if client.kc is not None:
        client.kc.stop_channels()
    if kernel.has_kernel:
        kernel.shutdown_kernel()  # asks the kernel to exit (its atexit handlers run); kills it after a few seconds


# ---------------------------------------------------------------------------------------------
# What an executed lesson shows


CHECK_CALLS = ("check", "check_between", "skip_check")  # gk.check, gk.check_between, gk.skip_check (gpukit/claims.py)


def is_check_node(node: ast.AST) -> bool:
    """An `assert` statement, or a call of one of the lessons' check helpers (`gk.check(...)`, `check_between(...)`)."""
    if isinstance(node, ast.Assert):
        return True
    if not isinstance(node, ast.Call):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return name in CHECK_CALLS


def is_check(source: str) -> bool:
    """A check cell holds an `assert` statement or calls gk.check, gk.check_between or gk.skip_check (found by
    parsing, so a comment or a string saying "assert" does not count; a cell that does not parse counts if a line
    starts with one)."""
    try:
        return any(is_check_node(node) for node in ast.walk(ast.parse(source)))
    except SyntaxError:
        return re.search(r"^\s*(assert\b|gk\.(check|check_between|skip_check)\()", source, re.M) is not None


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


def _errors(cell) -> list:
    return [output for output in cell.get("outputs", []) if output.output_type == "error"]


def check_outcome(cell) -> str:
    """failed (an error), not run, skipped (it ran but printed only "skipped" lines: it asserted nothing here), or
    passed (a plain `assert` cell that printed no line at all passed, as before the helpers)."""
    if _errors(cell):
        return "failed"
    if cell.get("execution_count") is None:
        return "not run"
    printed = "".join(_text(output) for output in cell.get("outputs", []))
    if UNATTEMPTED_LINE.search(printed) and not PASSED_LINE.search(printed):
        return "not attempted"
    return "skipped" if SKIPPED_LINE.search(printed) and not PASSED_LINE.search(printed) else "passed"


def _check(index: int, cell) -> Check:
    printed = "".join(_text(output) for output in cell.get("outputs", []))
    skipped, passed = len(SKIPPED_LINE.findall(printed)), len(PASSED_LINE.findall(printed))
    return Check(index, cell.get("id", ""), check_outcome(cell), skipped, passed)


def _run_facts(notebook) -> tuple[str, str]:
    """(profile, device) as the lesson's setup cell printed them, e.g. ("gpu", "cuda · NVIDIA H100 80GB HBM3")."""
    for cell in notebook.cells[:6]:
        for output in cell.get("outputs", []):
            found = ENV_LINE.search(_text(output))
            if found:
                gpus = found["gpus"].split(";")[0].strip()  # "none; not usable: …" on a machine torch cannot use
                device = found["device"] if found["device"] != "cuda" else f"cuda · {gpus}"
                return found["profile"], device
    return "unknown", "unknown"


def _when(notebook, path: Path | None) -> tuple[str, float | None]:
    """When the lesson ran and for how long: from its metadata, else (a notebook saved by Jupyter) the file's date."""
    ran = notebook.metadata.get(METADATA_KEY, {})
    if ran.get("executed"):
        return ran["executed"].replace("T", " ")[:16], ran.get("seconds")
    if path is not None:
        return datetime.datetime.fromtimestamp(path.stat().st_mtime).isoformat(" ", "minutes"), None
    return "unknown", None


def _title(notebook, name: str) -> str:
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            heading = re.search(r"^#\s+(.+)$", cell.source, re.M)
            if heading:
                return heading.group(1).replace("`", "").strip()
    return name


def _problems(notebook, figures: int) -> list[str]:
    problems = []
    for index, cell in enumerate(notebook.cells):
        for error in _errors(cell):
            problems.append(f"cell {index} (id {cell.get('id')}) raised {error.ename}: {error.evalue}"[:300])
    stopped = notebook.metadata.get(METADATA_KEY, {}).get("stopped")
    if stopped:
        problems.append(f"stopped: {stopped}")
    code = [(index, cell) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code" and cell.source]
    unrun = [index for index, cell in code if cell.get("execution_count") is None]
    if unrun and not problems:  # after an error the rest is unrun: the error is the news
        problems.append(f"cells {', '.join(map(str, unrun))} did not run")
    if figures == 0:
        problems.append("showed no figure: every lesson plots what it measures")
    return problems


def describe(notebook, name: str, path: Path | None = None) -> Lesson:
    """What an executed lesson shows: its checks' outcomes, its exercises', its figures and what fails the build."""
    code = [(index, cell) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    checks = [_check(index, cell) for index, cell in code if is_check(cell.source) and exercise_key(cell) is None]
    exercises = [_check(index, cell) for index, cell in code if exercise_key(cell) is not None]
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    figures = sum(any(kind in output.get("data", {}) for kind in FIGURE_TYPES) for output in outputs)
    profile, device = _run_facts(notebook)
    executed, seconds = _when(notebook, path)
    problems = _problems(notebook, figures)
    facts = (profile, device, executed, seconds, figures)
    return Lesson(name, _title(notebook, name), *facts, checks=checks, problems=problems, exercises=exercises)


# ---------------------------------------------------------------------------------------------
# The site


def lesson_paths(source: Path) -> list[Path]:
    paths = sorted(Path(source).glob(LESSON_GLOB))
    if not paths:
        raise FileNotFoundError(f"no lessons (NN_name.ipynb) in {source}: name a folder of lesson notebooks")
    return paths


def build(
    out: Path,
    lessons: Path | None = None,
    executed: Path | None = None,
    profile: str | None = None,
    cell_seconds: float = CELL_SECONDS,
    report=print,
) -> list[Lesson]:
    """Write the site into `out`: a page and the executed notebook per lesson, and index.html. The lessons in
    `lessons` (default: gpukit's own) are run here, or those already executed in `executed` are published.
    Returns every lesson's description; those with `problems` fail the build (`main` exits 1)."""
    source = Path(executed if executed is not None else lessons or folder("lessons"))
    if source.resolve() == out.resolve():  # the stale pages removed below would be the lessons themselves
        raise ValueError(f"the site's folder {out} holds the lessons to publish: write the site somewhere else")
    paths = lesson_paths(source)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.html"), *out.glob(LESSON_GLOB)]:  # a lesson renamed or gone since the last build
        stale.unlink()
    notebooks, described = [], []
    for path in paths:
        notebook = nbformat.read(path, as_version=4) if executed is not None else execute(path, profile, cell_seconds)
        lesson = describe(notebook, path.stem, path if executed is not None else None)
        nbformat.write(notebook, out / f"{lesson.name}.ipynb")  # now: a build stopped later keeps what ran
        notebooks.append(notebook)
        described.append(lesson)
        took = f", {lesson.seconds:.0f} s" if lesson.seconds is not None else ""
        report(
            f"site: {lesson.name}: {lesson.passed} of {len(lesson.checks)} checks passed"
            + (f", {lesson.skipped} skipped" if lesson.skipped else "")
            + f", {lesson.figures} figures{took}"
        )
    for index, (notebook, lesson) in enumerate(zip(notebooks, described)):
        before = described[index - 1] if index > 0 else None
        after = described[index + 1] if index + 1 < len(described) else None
        (out / f"{lesson.name}.html").write_text(render_lesson(notebook, lesson, before, after), encoding="utf-8")
    (out / "index.html").write_text(render_index(described, git_commit(Path(__file__).parent)), encoding="utf-8")
    return described


def main(
    out: Path,
    lessons: Path | None = None,
    executed: Path | None = None,
    profile: str | None = None,
    cell_seconds: float = CELL_SECONDS,
) -> int:
    """`gpukit site`: build, say where, and return 1 (naming each lesson and cell) if a lesson failed."""
    described = build(Path(out), lessons, executed, profile, cell_seconds)
    failed = [(lesson.name, problem) for lesson in described for problem in lesson.problems]
    for name, problem in failed:
        print(f"site: {name}: {problem}")
    pages = Path(out).resolve() / "index.html"
    if failed:
        print(
            f"site: {len({name for name, _ in failed})} lesson(s) failed; the pages are in {pages}, not fit to publish"
        )
        return 1
    skipped = sum(lesson.skipped for lesson in described)
    said = f" ({skipped} check cells skipped here)" if skipped else ""
    print(f"site: {len(described)} lessons, every check that ran passed{said}; open {pages}")
    return 0
