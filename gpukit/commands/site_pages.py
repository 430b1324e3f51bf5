"""The site's pages (`gpukit site`, gpukit/commands/site.py): a lesson executed as one self-contained HTML page, and
the index of them all.

nbconvert's JupyterLab template renders each page, less what it would load from the web, with the lesson's run
facts in a bar on top, a pill under each check cell, a hidden cell's code folded and each exercise's solution
folded under its check; images from elsewhere (the Open in Colab badges) become their words, so a page reads offline.
"""

from __future__ import annotations

import copy
import datetime
import html
import re
from dataclasses import dataclass, field

from jinja2 import DictLoader
from nbconvert import HTMLExporter
from nbconvert.preprocessors import CoalesceStreamsPreprocessor

from .. import practice

WIDGET_TYPE = "application/vnd.jupyter.widget-view+json"


@dataclass
class Check:
    cell: int  # the cell's index in the notebook, counted from 0 as nbformat does
    cell_id: str
    status: str  # "passed" (ran without error), "failed", "not run", or "skipped" (every check it holds skipped)
    skipped: int = 0  # lines starting "skipped" that the cell printed: checks this machine cannot make
    passed_lines: int = 0  # lines starting "check passed": checks that ran and held (a plain assert prints none)

    @property
    def label(self) -> str:
        if self.status == "skipped":
            # It printed only "skipped" lines: no check of it says it ran (a plain assert would say nothing either).
            what = "check" if self.skipped == 1 else f"{self.skipped} checks"
            return f"– {what} skipped here (see below)"
        if self.status == "passed" and self.skipped:
            ran = self.passed_lines
            return f"✓ {ran} of {ran + self.skipped} checks ran and passed · {self.skipped} skipped here (see below)"
        if self.status == "passed" and self.passed_lines > 1:
            return f"✓ {self.passed_lines} checks passed"
        labels = {"passed": "✓ check passed", "failed": "✗ check failed", "not run": "– check not run"}
        labels["not attempted"] = "– exercise not attempted: its check measures here once you answer"
        return labels[self.status]


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
    exercises: list[Check] = field(default_factory=list)  # the Practice section's check cells, apart from the claims'

    @property
    def passed(self) -> int:
        return sum(check.status == "passed" for check in self.checks)

    @property
    def skipped(self) -> int:
        """Check cells that asserted nothing here: every check they hold was skipped."""
        return sum(check.status == "skipped" for check in self.checks)


def exercise_key(cell) -> str | None:
    """The exercise a Practice section's check cell checks ("03.model_state"), from its metadata; else None."""
    found = cell.get("metadata", {}).get("gpukit", {})
    return found.get("exercise") if found.get("role") == "check" else None


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
.gk-skipped { background: #fff4d6; color: #7a5200; border: 1px solid #e0b650; }
.gk-not-attempted { background: #eef2fb; color: #33466e; border: 1px solid #9fb0d6; }
details.gk-solution > pre { margin: 2px 0 8px 64px; padding: 6px 10px; background: #f7f7f7; font-size: 13px; }
details.gk-hidden > summary { font-family: system-ui, sans-serif; font-size: 13px; color: #555; cursor: pointer;
  margin: 2px 0 2px 64px; }
table.gk-index { border-collapse: collapse; font-size: 14px; }
table.gk-index th, table.gk-index td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }
"""

# nbconvert's JupyterLab template, less what it would load from the web (require.js, MathJax, Mermaid, the
# widget renderer: the lessons need none of them, and the pages then read offline), plus the lesson's bar on
# top, a cell's code folded where JupyterLab hides it, and a pill under each check cell.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock %}
{% block jupyter_widgets %}{% endblock %}
{% block html_head_js_mathjax %}{% endblock %}
{% block html_head_js_mermaidjs %}{% endblock %}
{% block extra_css %}<style type="text/css">{{ resources.gpukit.style }}</style>{% endblock %}
{% block body_header %}{{ super() }}{{ resources.gpukit.bar }}{% endblock %}
{% block input_group %}
{%- if cell.metadata.get("jupyter", {}).get("source_hidden") -%}
<details class="gk-hidden"><summary>{{ "check" if cell.metadata.get("gpukit_check") else "code" }} (code hidden)</summary>
{{ super() }}</details>
{%- else -%}{{ super() }}{%- endif -%}
{%- set check = cell.metadata.get("gpukit_check") -%}
{%- if check %}<div class="gk-check gk-{{ check.status | replace(' ', '-') }}">{{ check.label | e }}</div>{% endif %}
{%- set solution = cell.metadata.get("gpukit_solution") -%}
{%- if solution %}<details class="gk-hidden gk-solution"><summary>our solution (try the hints first)</summary>
<pre>{{ solution | e }}</pre></details>{% endif %}
{% endblock input_group %}
"""


# An image from elsewhere in a markdown cell: ![alt](https://…) or <img … src="https://…" …>. The lessons' Open in
# Colab and Kaggle badges are such images; offline they show broken, so the page shows their words instead (a badge
# wrapped in a link stays a link).
REMOTE_MARKDOWN_IMAGE = re.compile(r"!\[([^\]]*)\]\(\s*(?:https?:)?//[^)\s]+(?:\s+\"[^\"]*\")?\s*\)")
REMOTE_HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc=[\"']?(?:https?:)?//[^>]*>", re.I)


def without_remote_images(markdown: str) -> str:
    """`markdown` with each image from elsewhere replaced by its alt text ("Open in Colab")."""
    markdown = REMOTE_MARKDOWN_IMAGE.sub(lambda found: found[1] or "image", markdown)
    alt = re.compile(r"\balt=[\"']([^\"']*)[\"']", re.I)
    return REMOTE_HTML_IMAGE.sub(lambda found: (alt.search(found[0]) or [None, "image"])[1], markdown)


def _for_the_page(notebook, lesson: Lesson):
    """A copy of `notebook` to render: widget outputs (a progress bar's live view: its text line stays) and the
    widgets' state dropped, images from elsewhere made words, streams joined, each check cell marked with its outcome
    for the template."""
    notebook = copy.deepcopy(notebook)
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if WIDGET_TYPE not in output.get("data", {})]
        elif cell.cell_type == "markdown":
            cell.source = without_remote_images(cell.source)
    notebook, _ = CoalesceStreamsPreprocessor().preprocess(notebook, {})
    for check in lesson.checks + lesson.exercises:
        notebook.cells[check.cell].metadata["gpukit_check"] = {"status": check.status, "label": check.label}
    solutions = solution_code()
    for exercise in lesson.exercises:
        cell = notebook.cells[exercise.cell]
        cell.metadata["gpukit_solution"] = solutions.get(exercise_key(cell), "")
    return notebook


def solution_code() -> dict[str, str]:
    """Each exercise's solution, by key: the site shows it folded under the exercise's check."""
    return {exercise.key: exercise.solution_code for lesson in practice.lessons() for exercise in lesson.EXERCISES}


def _run_line(lesson: Lesson) -> str:
    took = f" · {lesson.seconds:.0f} s" if lesson.seconds is not None else ""
    return (
        f"profile <b>{html.escape(lesson.profile)}</b> · device <b>{html.escape(lesson.device)}</b> · run "
        f"{html.escape(lesson.executed)}{took} · <b>{lesson.passed} of {len(lesson.checks)}</b> checks passed"
        + (f" · {lesson.skipped} skipped here" if lesson.skipped else "")
        + (f" · {len(lesson.exercises)} exercises (solutions folded)" if lesson.exercises else "")
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
            f'<span class="gk-check {status}">{lesson.passed} of {len(lesson.checks)}</span>'
            + (f' <span class="gk-check gk-skipped">{lesson.skipped} skipped</span>' if lesson.skipped else ""),
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
<p>Every lesson as it ran, with its figures, tables and the outcome of each check cell. The profile sets the sizes:
<code>tiny</code> runs in CI on a CPU, where the checks that need a GPU say they were skipped (a cell whose every
check was skipped counts as skipped, not passed); <code>gpu</code> is the full size on a CUDA GPU. Built {html.escape(built)}{html.escape(source)}.</p>
<table class="gk-index"><thead><tr>{header}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table></main></body></html>
"""
