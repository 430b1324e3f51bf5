"""Lessons 00 and 01 as a learner runs them: JupyterLab in headless Chromium, "Run All Cells" from the menu.

Checks what nbval cannot see: opening a lesson does not mark it modified and closing it leaves the file
byte-identical (gpukit lab's contents manager, gpukit/jupyter.py), no news pop-up covers it (the settings file make
setup copies into the .venv), every cell ran with no error output, the live training progress bar rendered as a
widget (not its text fallback) while training ran and then became one final text line, and the figures appeared as
images.
A screenshot of each notebook and an image of each figure go to the folder the test prints.

Needs Chromium on the PATH (Debian: `apt-get install chromium`; `.ci/run` installs it) and Playwright for
Python (the `dev` extra); skipped with one line otherwise. Playwright's own browser download is not used.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gpukit.jupyter import lab_command

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ["00_environment_and_cpu_vs_gpu.ipynb", "01_train_a_cnn.ipynb"]
ARTIFACTS = ROOT / "tests" / "artifacts"  # git-ignored
# Seconds for "Run All" of one lesson: 62-86 s on the idle 2-core machine; with two busy processes beside the
# suite, lesson 01 was still on its last cell after 480 s (JupyterLab and Chromium share the same two cores).
CELL_TIMEOUT_S = 900

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on the PATH (Debian: apt-get install chromium)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[dev]')"),
    pytest.mark.timeout(CELL_TIMEOUT_S + 300),  # the page's own timeout reports first, with a screenshot
]


def makefile_variable(name: str) -> str:
    """A variable of the Makefile (`make lab` and `make setup` use them), so the test runs what they run."""
    match = re.search(rf"^{name}\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile defines {name}"
    return match.group(1).strip()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def quiet_settings(settings: Path) -> Path:
    """JupyterLab user settings for a test: every cell in the page, no autosave. (No news pop-up: make lab's own
    settings file does that, see lab_defaults.)"""
    for plugin, values in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},  # every cell in the page
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},  # the test saves when it means to
    }.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return settings


def lab_defaults(folder: Path) -> Path:
    """A JupyterLab app-settings folder with the defaults make setup copies into the .venv (overrides.d/gpukit.json,
    from tools/jupyterlab-overrides.json): what `make lab`'s JupyterLab reads."""
    match = re.search(r"cp (\S+) \$\(LAB_OVERRIDES\)/(\S+)", (ROOT / "Makefile").read_text())
    assert match, "make setup copies JupyterLab's defaults into $(LAB_OVERRIDES)"
    (folder / "overrides.d").mkdir(parents=True)
    shutil.copy(ROOT / match[1], folder / "overrides.d" / match[2])
    return folder


def wait_for_server(url: str, token: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180  # seconds; a loaded 2-core machine needs ~30-60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start; see {log}:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free port with a token, serving a temporary copy of the lessons."""
    base = tmp_path_factory.mktemp("lab")
    notebooks = base / "notebooks"
    for folder in ("run", "open"):  # one copy to run, one to open and close: each has its own kernel
        (notebooks / folder).mkdir(parents=True)
        for name in LESSONS:
            shutil.copy2(ROOT / "notebooks" / name, notebooks / folder / name)
    # The kernel exactly as the Makefile installs it (this Python, the Makefile's display name), in a private
    # prefix so that kernels installed elsewhere on the machine do not stand in for it.
    prefix = base / "prefix"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ipykernel",
            "install",
            "--prefix",
            str(prefix),
            "--name",
            "python3",
            "--display-name",
            makefile_variable("KERNEL_DISPLAY_NAME"),
        ],
        check=True,
        capture_output=True,
    )
    settings = quiet_settings(base / "settings")
    port, token = free_port(), os.urandom(16).hex()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        JUPYTER_PATH=str(prefix / "share" / "jupyter"),
        JUPYTER_CONFIG_DIR=str(base / "config"),
        JUPYTER_RUNTIME_DIR=str(base / "runtime"),
        GPUKIT_PROFILE="tiny",
        MPLBACKEND="",
    )
    env.pop("MPLBACKEND")
    log = (base / "jupyter.log").open("w")
    server = subprocess.Popen(
        lab_command(  # what `gpukit lab` (and so `make lab`) runs, with the test's own options after it
            notebooks,
            [
                "--no-browser",
                f"--port={port}",
                "--ip=127.0.0.1",
                f"--IdentityProvider.token={token}",
                f"--LabApp.user_settings_dir={settings}",
                f"--LabApp.app_settings_dir={lab_defaults(base / 'app-settings')}",
                f"--LabApp.workspaces_dir={base / 'workspaces'}",
            ],
        ),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, token, server, base / "jupyter.log")
        yield {"url": url, "token": token, "notebooks": notebooks}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def page(lab):
    ARTIFACTS.mkdir(exist_ok=True)
    print(f"\nbrowser screenshots: {ARTIFACTS}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield page
        browser.close()


def open_notebook(page, lab, path):
    page.goto(f"{lab['url']}/lab/tree/{path}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    # The kernel has started and answered: the status bar reads "Python 3 | Idle".
    page.locator(".jp-StatusBar-Item", has_text=re.compile(r"\| Idle")).first.wait_for(timeout=90_000)


def menu(page, top: str, item: str):
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{top}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).first.click()


@pytest.mark.parametrize("name", LESSONS)
def test_open_and_close_leaves_the_file_unchanged(page, lab, name):
    path = lab["notebooks"] / "open" / name
    before = path.read_bytes()
    open_notebook(page, lab, f"open/{name}")
    page.wait_for_timeout(3000)  # the kernel's info (language, spec) reaches the notebook's metadata
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=name)
    assert "jp-mod-dirty" not in (tab.get_attribute("class") or ""), f"{name}: marked modified on opening"
    assert page.get_by_text("official Jupyter news").count() == 0, "the news pop-up covers the lesson"
    page.keyboard.press("Control+s")  # a save, as autosave or a learner's habit makes: the file must not change
    page.wait_for_timeout(1500)
    menu(page, "File", "Close Tab")
    page.wait_for_timeout(500)
    assert page.locator(".jp-Dialog").count() == 0, f"{name}: closing asks to save changes"
    changed = difflib.unified_diff(before.decode().splitlines(), path.read_text().splitlines(), lineterm="")
    assert path.read_bytes() == before, f"{name}: opening and closing changed the file:\n" + "\n".join(changed)


@pytest.mark.parametrize("name", LESSONS)
def test_run_all_cells(page, lab, name):
    started = time.perf_counter()
    open_notebook(page, lab, f"run/{name}")
    menu(page, "Run", "Run All Cells")
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputPrompt")
    deadline, quiet_polls, widget_bars = time.monotonic() + CELL_TIMEOUT_S, 0, 0
    while quiet_polls < 3:  # three polls in a row with the kernel idle and nothing queued: Run All is over
        page.wait_for_timeout(1000)
        # A training bar is a live widget only while it runs: seen by polling.
        widget_bars = max(widget_bars, page.locator(".jp-OutputArea-output .widget-hprogress").count())
        texts = [text.strip() for text in prompts.all_inner_texts()]
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
        started_running = any(text != "[ ]:" for text in texts)
        quiet_polls = quiet_polls + 1 if idle and started_running and "[*]:" not in texts else 0
        if time.monotonic() > deadline:
            page.screenshot(path=ARTIFACTS / f"{name.removesuffix('.ipynb')}_timeout.png")
            raise AssertionError(f"{name}: cells still running after {CELL_TIMEOUT_S} s: {texts}")
    ran_s = time.perf_counter() - started
    page.keyboard.press("Control+s")
    page.wait_for_timeout(1500)
    notebook = json.loads((lab["notebooks"] / "run" / name).read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    not_run = [i for i, cell in enumerate(code) if cell["execution_count"] is None]
    errors = [output for cell in code for output in cell["outputs"] if output["output_type"] == "error"]
    stem = name.removesuffix(".ipynb")
    images = page.locator(".jp-OutputArea-output img")
    for index in range(images.count()):
        images.nth(index).screenshot(path=ARTIFACTS / f"{stem}_figure{index + 1}.png")
    # The whole notebook in one picture: a window as tall as the notebook's scrolled content (16000 px at most).
    scrolled, shown = page.evaluate(
        "(() => { const outer = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');"
        " return outer ? [outer.scrollHeight, outer.clientHeight] : [0, 0]; })()"
    )
    page.set_viewport_size({"width": 1400, "height": min(1000 + max(0, scrolled - shown), 16000)})
    page.wait_for_timeout(500)
    page.screenshot(path=ARTIFACTS / f"{stem}.png")
    page.set_viewport_size({"width": 1400, "height": 1000})
    print(f"{name}: ran in {ran_s:.0f} s; {images.count()} images")
    assert not errors, f"{name}: error output {errors[0]['ename']}: {errors[0]['evalue']}"
    assert not not_run, f"{name}: code cells {not_run} did not run"
    saved_images = sum("image/png" in output.get("data", {}) for cell in code for output in cell["outputs"])
    assert saved_images >= 1 and images.count() >= saved_images
    if name.startswith("01"):
        assert widget_bars >= 1, "the training progress bar did not render as a widget while it ran"
        assert page.get_by_text("Loading widget...").count() == 0
        # Each bar ended as one output, its final text line, in the page and in the saved notebook.
        assert page.locator(".jp-OutputArea-output .widget-hprogress").count() == 0, "a widget bar was left"
        for cell in code:
            texts = [
                "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
                for out in cell["outputs"]
            ]
            finals = [text for text in texts if "100%|" in text]
            assert len(finals) == len(set(finals)), f"a bar shows twice: {finals}"
        shown = ["".join(out.get("data", {}).get("text/plain", "")) for cell in code for out in cell["outputs"]]
        assert any("100%|" in text for text in shown), "the saved notebook holds no bar's final text line"


def test_make_lab_opens_jupyterlab_as_root_too(page, tmp_path):
    """The README's first command as written, `make lab` (in this clone, whose .venv `make test` set up), with a
    user's own JupyterLab options in LAB_ARGS. CI runs as root, where JupyterLab refuses to start unless told
    --allow-root: `gpukit lab` adds it and says so. A screenshot of the page it serves goes to the artifacts."""
    port, token = free_port(), os.urandom(16).hex()
    options = [
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--LabApp.user_settings_dir={quiet_settings(tmp_path / 'settings')}",
        f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
    ]
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    log_path = tmp_path / "make-lab.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            ["make", "-C", str(ROOT), "lab", f"LAB_ARGS={' '.join(options)}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # make, gpukit lab and JupyterLab: one process group to stop
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_server(url, token, server, log_path)
            page.goto(f"{url}/lab?token={token}")
            lesson = page.locator(".jp-DirListing-itemText", has_text="00_environment_and_cpu_vs_gpu.ipynb")
            lesson.first.wait_for(timeout=120_000)  # the file browser lists the clone's lessons
            page.screenshot(
                path=ARTIFACTS / "make-lab-as-root.png" if os.geteuid() == 0 else ARTIFACTS / "make-lab.png"
            )
        finally:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)
    text = log_path.read_text()
    assert ("running as root: JupyterLab starts with --allow-root" in text) == (os.geteuid() == 0), text[-3000:]
