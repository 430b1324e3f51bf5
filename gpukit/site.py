"""`make site` (`gpukit site DIR`): every lesson executed, published as a static site of plain HTML files.

Each lesson runs top to bottom in a fresh Jupyter kernel (nbclient), in its notebook's folder as nbval runs it, in
the profile gpukit chooses for the machine (tiny in CI or on two cores, gpu with a CUDA GPU) or the one asked for.
`--from DIR` publishes notebooks executed before instead, running nothing: `make gpu-check` keeps the lessons it
ran in runs/gpu-check/DATE-TIME/notebooks/. nbconvert turns each lesson into one self-contained page (figures
embedded, no script or stylesheet loaded from elsewhere, so it reads offline), with a badge under each check (a
code cell with an `assert`): passed, failed or not run. index.html lists every lesson with its profile, device,
run date, time, checks passed and figures.

The build fails, naming the lesson and the cell, where a lesson raised an error, left a cell unrun or showed no
figure: CI publishes nothing rather than a broken lesson. Why nbconvert and not Jupyter Book or mkdocs-jupyter:
docs/site.md.
"""

from __future__ import annotations

import ast
import copy
import datetime
import html
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import ipykernel.kernelspec
import nbformat
from jinja2 import DictLoader
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from nbconvert import HTMLExporter
from nbconvert.preprocessors import CoalesceStreamsPreprocessor

from .gpucheck import child_environment
from .runfile import git_commit
from .shipped import folder

LESSON_GLOB = "[0-9][0-9]*_*.ipynb"
CELL_SECONDS = 600  # one cell; the tiny profile runs a whole lesson in 30-200 s on two busy cores
METADATA_KEY = "gpukit"  # the notebook's metadata that says when it ran: {"executed": ISO time, "seconds": …}
FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
WIDGET_TYPE = "application/vnd.jupyter.widget-view+json"
# The setup cell of every lesson prints the Env: "device=cuda gpus=1 (NVIDIA H100 80GB HBM3) bf16=True … profile=gpu (…)"
ENV_LINE = re.compile(r"^device=(?P<device>\S+) gpus=\d+ \((?P<gpus>.*)\) bf16=.* profile=(?P<profile>\w+)", re.M)
SKIPPED_LINE = re.compile(r"^skipped\b", re.M | re.I)  # a check's part that needs a GPU says it was skipped


@dataclass
class Check:
    cell: int  # the cell's index in the notebook, counted from 0 as nbformat does
    cell_id: str
    status: str  # "passed" (ran without error), "failed" or "not run"
    skipped: int = 0  # lines starting "skipped" that the cell printed: parts of the check this machine cannot do

    @property
    def label(self) -> str:
        marks = {"passed": "✓ check passed", "failed": "✗ check failed", "not run": "– check not run"}
        parts = f" · {self.skipped} part{'s' * (self.skipped > 1)} skipped here (see below)" if self.skipped else ""
        return marks[self.status] + parts


@dataclass
class Lesson:
    name: str  # the notebook's stem, "00_environment_and_cpu_vs_gpu"
    title: str
    profile: str
    device: str
    executed: str  # when it ran, "2025-05-01 14:03" (local time), or "unknown"
    seconds: float | None
    figures: int
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why the build fails: "cell 12 (id …): AssertionError: …"

    @property
    def passed(self) -> int:
        return sum(check.status == "passed" for check in self.checks)


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
    environment = child_environment(Path(__file__).resolve().parents[1], **variables)
    environment.pop("MPLBACKEND", None)
    kernel = KernelManager(kernel_spec_manager=ThisPython())
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
    if _errors(cell):
        return "failed"
    return "not run" if cell.get("execution_count") is None else "passed"


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
    """What an executed lesson shows: its checks' outcomes, its figures and what would fail the build."""
    checks = [
        Check(
            index,
            cell.get("id", ""),
            check_outcome(cell),
            sum(len(SKIPPED_LINE.findall(_text(o))) for o in cell.outputs),
        )
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and is_check(cell.source)
    ]
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    figures = sum(any(kind in output.get("data", {}) for kind in FIGURE_TYPES) for output in outputs)
    profile, device = _run_facts(notebook)
    executed, seconds = _when(notebook, path)
    problems = _problems(notebook, figures)
    return Lesson(name, _title(notebook, name), profile, device, executed, seconds, figures, checks, problems)


# ---------------------------------------------------------------------------------------------
# Pages

STYLE = """
.gk-bar { font-family: system-ui, sans-serif; font-size: 14px; padding: 8px 16px; margin-bottom: 8px;
  border-bottom: 1px solid #ddd; background: #f7f7f7; }
.gk-bar a { margin-right: 1em; }
.gk-run { color: #333; margin-top: 4px; }
.gk-check { font-family: system-ui, sans-serif; font-size: 13px; display: inline-block; margin: 2px 0 4px 64px;
  padding: 1px 8px; border-radius: 10px; }
.gk-passed { background: #e3f4e1; color: #1b5e20; border: 1px solid #8bc48a; }
.gk-failed { background: #fde2e1; color: #8e1c15; border: 1px solid #e08b86; }
.gk-not-run { background: #eee; color: #555; border: 1px solid #bbb; }
table.gk-index { border-collapse: collapse; font-size: 14px; }
table.gk-index th, table.gk-index td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }
"""

# nbconvert's JupyterLab template, less what it would load from the web (require.js, MathJax, Mermaid, the
# widget renderer: the lessons need none of them, and the pages then read offline), plus the lesson's bar on
# top and a badge under each check cell.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock %}
{% block jupyter_widgets %}{% endblock %}
{% block html_head_js_mathjax %}{% endblock %}
{% block html_head_js_mermaidjs %}{% endblock %}
{% block extra_css %}<style type="text/css">{{ resources.gpukit.style }}</style>{% endblock %}
{% block body_header %}{{ super() }}{{ resources.gpukit.bar }}{% endblock %}
{% block input_group %}{{ super() }}
{%- set check = cell.metadata.get("gpukit_check") -%}
{%- if check %}<div class="gk-check gk-{{ check.status | replace(' ', '-') }}">{{ check.label | e }}</div>{% endif %}
{% endblock input_group %}
"""


def _for_the_page(notebook, lesson: Lesson):
    """A copy of `notebook` to render: widget outputs (a progress bar's live view: its text line stays) and the
    widgets' state dropped, streams joined, each check cell marked with its outcome for the template."""
    notebook = copy.deepcopy(notebook)
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if WIDGET_TYPE not in output.get("data", {})]
    notebook, _ = CoalesceStreamsPreprocessor().preprocess(notebook, {})
    for check in lesson.checks:
        notebook.cells[check.cell].metadata["gpukit_check"] = {"status": check.status, "label": check.label}
    return notebook


def _run_line(lesson: Lesson) -> str:
    took = f" · {lesson.seconds:.0f} s" if lesson.seconds is not None else ""
    return (
        f"profile <b>{html.escape(lesson.profile)}</b> · device <b>{html.escape(lesson.device)}</b> · run "
        f"{html.escape(lesson.executed)}{took} · <b>{lesson.passed} of {len(lesson.checks)}</b> checks passed"
    )


def render_lesson(notebook, lesson: Lesson, before: Lesson | None, after: Lesson | None) -> str:
    """The lesson's page: its cells and outputs as JupyterLab shows them, a bar with the run's facts and links."""
    links = ['<a href="index.html">← all lessons</a>']
    links += [
        f'<a href="{x.name}.html">{label} {html.escape(x.title)}</a>' for x, label in ((before, "‹"), (after, "›")) if x
    ]
    links.append(f'<a href="{lesson.name}.ipynb" download>the executed notebook (.ipynb)</a>')
    bar = f'<div class="gk-bar"><nav>{"".join(links)}</nav><div class="gk-run">{_run_line(lesson)}</div></div>'
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[DictLoader({"gpukit-site.html.j2": TEMPLATE})],
        template_file="gpukit-site.html.j2",
    )
    page, _ = exporter.from_notebook_node(
        _for_the_page(notebook, lesson),
        resources={"gpukit": {"style": STYLE, "bar": bar}, "metadata": {"name": lesson.title}},
    )
    return page


def render_index(lessons: list[Lesson], commit: str | None) -> str:
    """index.html: one row per lesson, linking to its page."""
    rows = []
    for lesson in lessons:
        took = f"{lesson.seconds:.0f} s" if lesson.seconds is not None else ""
        status = "gk-passed" if not lesson.problems else "gk-failed"
        cells = [
            f'<a href="{lesson.name}.html">{html.escape(lesson.title)}</a>',
            html.escape(lesson.profile),
            html.escape(lesson.device),
            html.escape(lesson.executed),
            took,
            f'<span class="gk-check {status}">{lesson.passed} of {len(lesson.checks)}</span>',
            str(lesson.figures),
        ]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    built = datetime.datetime.now().isoformat(" ", "minutes")
    source = f", gpukit commit {commit[:12]}" if commit else ""
    header = "".join(
        f"<th>{name}</th>" for name in ("lesson", "profile", "device", "run", "time", "checks passed", "figures")
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>gpukit lessons, executed</title><style>body {{ font-family: system-ui, sans-serif; margin: 2em; }}{STYLE}</style>
</head><body><main>
<h1>gpukit lessons, executed</h1>
<p>Every lesson as it ran, with its figures, tables and the outcome of each check (a cell with an <code>assert</code>).
The profile sets the sizes: <code>tiny</code> runs in CI on a CPU, where the checks that need a GPU say they were
skipped; <code>gpu</code> is the full size on a CUDA GPU. Built {html.escape(built)}{html.escape(source)}.</p>
<table class="gk-index"><thead><tr>{header}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table></main></body></html>
"""


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
            f"site: {lesson.name}: {lesson.passed} of {len(lesson.checks)} checks passed, {lesson.figures} figures{took}"
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
    print(f"site: {len(described)} lessons, every check passed; open {pages}")
    return 0
