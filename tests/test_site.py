"""The lessons' site (gpukit/site.py, `make site`), the notebooks gpu-check keeps for it, and its CI workflow.

Most tests read notebooks whose outputs are written here by hand (no kernel). Four run kernels: a small lesson
executed by the builder (seconds), two more to see that each kernel stops when its lesson ends (seconds), the same
through gpu-check's nbval command (slow: two pytest processes), and lesson 00 built in the tiny profile and opened in
headless Chromium (slow: about a minute). Executing every lesson is `make site`'s job.
"""

from __future__ import annotations

import html.parser
import re
import shutil
from pathlib import Path

import pytest
import torch

# gpukit.site needs nbconvert (the dev extra): without it (a GPU machine's wheels that lack it) this file is skipped
# with the reason, not a collection error that fails `gpu-check`'s tests step.
pytest.importorskip("nbconvert", reason="gpukit.site needs nbconvert (the dev extra): pip install nbconvert")
import nbformat  # noqa: E402  (after the skip: nbformat comes with nbconvert)
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output  # noqa: E402

from gpukit import cli, gpucheck, site  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
ENV_LINE = "device=cuda gpus=1 (NVIDIA H100 80GB HBM3) bf16=True tf32=True cpus=16 profile=gpu (a CUDA GPU)\n"
SETUP = "import gpukit as gk\nprint(gk.detect())"  # as the lessons' setup cell prints the Env
PLOT = "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()"
CHECK = "assert 1 + 1 == 2\nprint('check passed: arithmetic')"
FAILING_CHECK = "assert 1 + 1 == 3, 'one and one make two'"


def lesson(*sources: str, title: str = "A lesson"):
    """A notebook: a heading, then one code cell per source with ids c1, c2, … (cell i has id c{i})."""
    cells = [new_markdown_cell(f"# {title}")] + [new_code_cell(source) for source in sources]
    for index, cell in enumerate(cells):
        cell.id = f"c{index}"
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook


def ran(notebook, outputs: dict[int, list], unrun: tuple[int, ...] = ()):
    """`notebook` as if executed: cell i shows outputs[i]; the cells in `unrun` did not run."""
    for index, cell in enumerate(notebook.cells[1:], start=1):
        cell.execution_count = None if index in unrun else index
        cell.outputs = outputs.get(index, [])
    return notebook


def stdout(text: str):
    return new_output("stream", name="stdout", text=text)


def figure():
    return new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"})


def error(name: str, value: str):
    return new_output("error", ename=name, evalue=value, traceback=[f"{name}: {value}"])


def write(folder: Path, name: str, notebook) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / f"{name}.ipynb")
    return folder / f"{name}.ipynb"


class Loads(html.parser.HTMLParser):
    """What a page loads (scripts, stylesheets, images: (tag, address)) and the links it offers."""

    def __init__(self):
        super().__init__()
        self.loads, self.links = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and "href" in attrs:
            self.links.append(attrs["href"])
        elif tag in ("script", "img") and "src" in attrs:
            self.loads.append((tag, attrs["src"]))
        elif tag == "link" and "href" in attrs:
            self.loads.append((tag, attrs["href"]))


def parse(path: Path) -> Loads:
    page = Loads()
    page.feed(path.read_text())
    return page


# ---------------------------------------------------------------------------------------------
# Reading an executed lesson


def test_a_check_is_a_cell_with_an_assert_statement():
    assert site.is_check("assert x == 1")
    assert site.is_check("if gpu:\n    assert a < b, 'slower'\nelse:\n    print('skipped: needs a GPU')")
    assert not site.is_check("# we assert nothing here\nprint('assert')")
    assert not site.is_check("x = 1")
    # The lessons' check helpers (gpukit/claims.py) make a check cell too; a print or a comment naming them does not.
    assert site.is_check("gk.check_between(ratio, 0.8, 1.25, 'the timer agrees with a hand clock')")
    assert site.is_check("if gpu:\n    gk.check(a < b, 'faster')\nelse:\n    gk.skip_check('faster', 'no GPU')")
    assert not site.is_check("# gk.check(a, 'b') is what we would call\nprint('gk.check')")


def test_describe_reads_the_run_the_checks_and_the_figures():
    notebook = ran(
        lesson("print('setup')", PLOT, CHECK, "if False:\n    assert 0\nprint('skipped: the GPU part: no GPU')"),
        {1: [stdout(ENV_LINE)], 2: [figure()], 3: [stdout("check passed: arithmetic\n")], 4: [stdout("skipped: x\n")]},
    )
    notebook.metadata["gpukit"] = {"executed": "2026-11-24T15:16:03", "seconds": 33.2}
    lesson_ = site.describe(notebook, "00_a_lesson")
    assert (lesson_.title, lesson_.profile, lesson_.device) == ("A lesson", "gpu", "cuda · NVIDIA H100 80GB HBM3")
    assert (lesson_.executed, lesson_.seconds, lesson_.figures, lesson_.problems) == ("2026-11-24 15:16", 33.2, 1, [])
    assert [(check.cell, check.status, check.skipped) for check in lesson_.checks] == [
        (3, "passed", 0),
        (4, "passed", 1),
    ]
    assert lesson_.passed == 2 and "1 part skipped" in lesson_.checks[1].label


@pytest.mark.parametrize(
    "outputs, unrun, problem",
    [
        (
            {4: [error("AssertionError", "one and one make two")]},
            (5,),
            "cell 4 (id c4) raised AssertionError: one and one make two",
        ),
        ({}, (5,), "cells 5 did not run"),
    ],
    ids=["an error", "a cell not run"],
)
def test_an_error_or_an_unrun_cell_is_a_problem_naming_the_cell(outputs, unrun, problem):
    notebook = ran(lesson(SETUP, PLOT, CHECK, FAILING_CHECK, "print('after')"), {2: [figure()], **outputs}, unrun)
    described = site.describe(notebook, "01_broken")
    assert described.problems == [problem]
    statuses = [check.status for check in described.checks]
    assert statuses == (["passed", "failed"] if outputs else ["passed", "passed"])


def test_a_lesson_without_a_figure_is_a_problem():
    notebook = ran(lesson(SETUP, CHECK), {1: [stdout(ENV_LINE)], 2: [stdout("check passed\n")]})
    assert site.describe(notebook, "02_plain").problems == ["showed no figure: every lesson plots what it measures"]


# ---------------------------------------------------------------------------------------------
# Building from executed lessons (--from)


def executed_lessons(folder: Path) -> None:
    good = ran(
        lesson(SETUP, PLOT, CHECK, title="00 · Good"), {1: [stdout(ENV_LINE)], 2: [figure()], 3: [stdout("ok\n")]}
    )
    good.metadata["gpukit"] = {"executed": "2026-11-24T15:00:00", "seconds": 12.0}
    broken = ran(
        lesson(SETUP, PLOT, CHECK, FAILING_CHECK, "print('after')", title="01 · Broken"),
        {1: [stdout(ENV_LINE)], 2: [figure()], 4: [error("AssertionError", "one and one make two")]},
        unrun=(5,),
    )
    write(folder, "00_good", good)
    write(folder, "01_broken", broken)


def test_the_build_fails_naming_the_lesson_and_the_cell(tmp_path, capsys):
    executed_lessons(tmp_path / "executed")
    assert site.main(tmp_path / "site", executed=tmp_path / "executed") == 1
    out = capsys.readouterr().out
    assert "site: 01_broken: cell 4 (id c4) raised AssertionError: one and one make two" in out.splitlines()
    assert "site: 00_good:" in out and "00_good: cell" not in out
    (tmp_path / "executed" / "01_broken.ipynb").unlink()
    assert site.main(tmp_path / "site", executed=tmp_path / "executed") == 0
    assert not (tmp_path / "site" / "01_broken.html").exists()  # the page of a lesson gone is gone too


def test_pages_show_each_check_and_load_nothing_from_elsewhere(tmp_path):
    executed_lessons(tmp_path / "executed")
    site.build(tmp_path / "site", executed=tmp_path / "executed", report=lambda line: None)
    pages = sorted(path.name for path in (tmp_path / "site").iterdir())
    assert pages == ["00_good.html", "00_good.ipynb", "01_broken.html", "01_broken.ipynb", "index.html"]
    index = (tmp_path / "site" / "index.html").read_text()
    assert parse(tmp_path / "site" / "index.html").links == ["00_good.html", "01_broken.html"]
    rows = re.findall(r"<tr>(.*?)</tr>", index, re.S)[1:]
    assert "cuda · NVIDIA H100 80GB HBM3" in rows[0] and ">1 of 1<" in rows[0] and "12 s" in rows[0]
    assert ">1 of 2<" in rows[1] and "gk-failed" in rows[1]
    broken = (tmp_path / "site" / "01_broken.html").read_text()
    assert broken.count("✓ check passed") == 1 and broken.count("✗ check failed") == 1
    assert "one and one make two" in broken and "1 of 2</b> checks passed" in broken
    for name in ("index.html", "00_good.html", "01_broken.html"):
        outside = [address for _, address in parse(tmp_path / "site" / name).loads if not address.startswith("data:")]
        assert not outside, f"{name} loads {outside}: the site must read offline"
    assert ("img", f"data:image/png;base64,{PNG}") in parse(tmp_path / "site" / "00_good.html").loads


def test_the_command_line(tmp_path, capsys):
    executed_lessons(tmp_path / "executed")
    assert cli.main(["site", str(tmp_path / "site"), "--from", str(tmp_path / "executed")]) == 1
    assert "01_broken: cell 4 (id c4)" in capsys.readouterr().out
    assert cli.main(["site", str(tmp_path / "site"), "--from", str(tmp_path)]) == cli.EXIT_BAD_INPUT
    assert "no lessons (NN_name.ipynb) in" in capsys.readouterr().err
    assert cli.main(["site", str(tmp_path / "executed"), "--from", str(tmp_path / "executed")]) == cli.EXIT_BAD_INPUT
    assert "holds the lessons to publish" in capsys.readouterr().err
    assert len(list((tmp_path / "executed").glob("*.ipynb"))) == 2  # nothing removed
    with pytest.raises(SystemExit):  # one source or the other
        cli.main(["site", str(tmp_path / "site"), "--from", str(tmp_path), "--lessons", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# Executing lessons: the builder's kernel, and gpu-check's nbval


def test_the_builder_runs_a_lesson_stops_at_its_error_and_plots_inline(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # a headless shell's setting, which would show no figure
    write(tmp_path / "lessons", "03_small", lesson(SETUP, PLOT, CHECK, FAILING_CHECK, CHECK))
    (described,) = site.build(tmp_path / "site", lessons=tmp_path / "lessons", profile="tiny", report=print)
    assert (described.profile, described.figures) == ("tiny", 1)
    assert described.device.split(" · ")[0] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert described.problems == ["cell 4 (id c4) raised AssertionError: one and one make two"]
    assert [check.status for check in described.checks] == ["passed", "failed", "not run"]
    assert described.seconds is not None and described.seconds > 0
    kept = nbformat.read(tmp_path / "site" / "03_small.ipynb", as_version=4)
    assert kept.cells[5].execution_count is None and kept.cells[3].outputs[0].text == "check passed: arithmetic\n"


def test_each_lessons_kernel_stops_when_the_lesson_ends(tmp_path, monkeypatch):
    """nbclient shuts down only a kernel manager it created itself; the builder gives it its own, so it must stop
    each kernel itself, or every lesson's kernel (and what it holds: GPU memory, workers) lives until the build ends.
    A lesson that stops at an error is done too."""
    started = []

    class RecordedKernel(site.KernelManager):
        def __init__(self, **options):
            super().__init__(**options)
            started.append(self)

    monkeypatch.setattr(site, "KernelManager", RecordedKernel)
    try:
        for name, cells in (("00_passes", (SETUP, CHECK)), ("01_fails", (SETUP, FAILING_CHECK, CHECK))):
            site.execute(write(tmp_path, name, lesson(*cells)), profile="tiny")
        assert len(started) == 2
        assert [kernel.is_alive() for kernel in started] == [False, False]
    finally:
        for kernel in started:  # what the builder left running, if it did
            if kernel.is_alive():
                kernel.shutdown_kernel(now=True)


@pytest.mark.slow  # two pytest processes that import torch, and a kernel: 10-60 s
def test_gpu_check_keeps_the_lessons_it_ran_for_the_site(tmp_path, monkeypatch):
    """gpu-check's own lesson command (nbval with gpukit.nbval_outputs) on a small lesson, then the site from it."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # its pytest imports this checkout's plugin
    write(tmp_path / "notebooks", "04_small", lesson(SETUP, PLOT, FAILING_CHECK, CHECK))
    logs = tmp_path / "logs"
    logs.mkdir()
    (result,) = gpucheck.run_lessons(tmp_path, logs, seconds=300, report=lambda line: None)
    assert result.status == "fail", result
    kept = nbformat.read(logs / "notebooks" / "04_small.ipynb", as_version=4)
    assert [cell.execution_count for cell in kept.cells[1:]] == [1, 2, 3, 4]  # nbval --nbval-lax runs on
    described = site.describe(kept, "04_small")
    assert described.profile == "gpu" and described.figures == 1  # gpu-check's profile, as the lesson printed it
    assert described.problems == ["cell 3 (id c3) raised AssertionError: one and one make two"]
    assert [check.status for check in described.checks] == ["failed", "passed"]
    assert site.main(tmp_path / "site", executed=logs / "notebooks") == 1


# ---------------------------------------------------------------------------------------------
# make site, the README and the workflow that publishes it


def makefile_site_dir() -> str:
    match = re.search(r"^SITE_DIR\s*:?=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "the Makefile defines SITE_DIR"
    return match.group(1)


def test_make_site_runs_the_builder_into_site_dir():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^site:.*\n\t(.+)$", makefile, re.M)
    assert recipe and "-m gpukit site $(SITE_DIR)" in recipe.group(1) and "--from $(FROM)" in recipe.group(1)
    assert f"{makefile_site_dir()}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_workflow_publishes_make_site_to_github_pages():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "site.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert triggers["push"]["branches"] == ["main"]
    assert workflow["permissions"]["pages"] == "write" and workflow["permissions"]["id-token"] == "write"
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    assert any(step.get("run", "").strip() == "make site" for step in build["steps"])
    (upload,) = [step for step in build["steps"] if step.get("uses", "").startswith("actions/upload-pages-artifact@")]
    assert upload["with"]["path"] == makefile_site_dir()
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert any(step.get("uses", "").startswith("actions/deploy-pages@") for step in deploy["steps"])


def test_the_readme_links_to_the_site():
    repository = re.search(
        r'^Repository = "https://github.com/([^/]+)/([^/"]+)"', (ROOT / "pyproject.toml").read_text(), re.M
    )
    owner, name = repository.groups()
    assert f"https://{owner}.github.io/{name}/" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# In a browser


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None


@pytest.mark.slow
@pytest.mark.timeout(900)  # lesson 00 in the tiny profile: ~35 s on an idle 2-core machine, minutes on a busy one
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on the PATH (Debian: apt-get install chromium)")
@pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[dev]')")
def test_every_lesson_has_a_page_with_a_figure_and_no_error_in_chromium(tmp_path):
    lessons = tmp_path / "lessons"
    lessons.mkdir()
    shutil.copy2(ROOT / "notebooks" / "00_environment_and_cpu_vs_gpu.ipynb", lessons)
    write(lessons, "01_small", lesson(SETUP, PLOT, CHECK, title="01 · A small lesson"))
    out = tmp_path / "site"
    assert site.main(out, lessons=lessons, profile="tiny") == 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        errors, fetched = [], []
        page.on("pageerror", lambda exception: errors.append(str(exception)))
        # Images may come from elsewhere (the lessons' Open in Colab badges); nothing the page needs to read may.
        page.on("request", lambda request: fetched.append(request.url) if request.resource_type != "image" else None)
        page.goto((out / "index.html").as_uri())
        links = page.locator("table a").evaluate_all("links => links.map(link => link.getAttribute('href'))")
        assert links == ["00_environment_and_cpu_vs_gpu.html", "01_small.html"]  # every lesson, in order
        for link in links:
            page.goto((out / link).as_uri())
            page.wait_for_load_state("load")
            assert "Traceback" not in page.locator("body").inner_text(), f"{link} shows an error's traceback"
            assert page.locator(".gk-failed, .gk-not-run").count() == 0 and page.locator(".gk-passed").count() >= 1
            sizes = page.locator(".jp-OutputArea-output img").evaluate_all("images => images.map(i => i.naturalWidth)")
            assert sizes and min(sizes) > 0, f"{link}: no figure was drawn ({sizes})"
        browser.close()
    assert not errors, errors
    outside = [url for url in fetched if not url.startswith("file:")]
    assert not outside, f"the pages fetched {outside}: they must read offline"
