"""`python -m gpukit gpu-check` without a GPU, and its parts on made-up step results (nothing here needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gpukit.commands import cli, gpucheck
from gpukit.commands.gpucheck import Machine, StepResult
from gpukit.distributed import scaling

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((REPO_ROOT / "benchmarks").glob("*.py"))
LESSONS = sorted(path.stem for path in (REPO_ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
MACHINE = Machine(["NVIDIA H100 80GB HBM3"], "580.159", "13.0", "2.11.0+cu130", "3.12.3", "0123456789ab", "2026-11-24")


def made_up_results() -> list[StepResult]:
    """One result of each kind and status, and a row for every lesson and benchmark this checkout has."""
    tests = StepResult(
        "tests",
        "-m gpu",
        "fail",
        41.0,
        "11 passed, 1 failed",
        {"test_memory": Counter(passed=7, skipped=1), "test_train": Counter(passed=4, failed=1)},
    )
    lessons = [StepResult("lesson", name, "pass", 30.0 + i, "cells: 25 passed") for i, name in enumerate(LESSONS)]
    lessons[1] = StepResult("lesson", LESSONS[1], "timeout", 300.2, "stopped after 300 s")
    figures = {
        "tables": [
            {
                "title": "step time",
                "columns": ["model", "ms | median", "ok"],
                "rows": [{"model": "resnet50", "ms | median": 12.345, "ok": True}],
            }
        ],
        "device": "H100",
    }
    benchmarks = [
        StepResult("benchmark", path.stem, "pass", 20.0, "1 table(s), 1 rows", figures=figures) for path in BENCHMARKS
    ]
    benchmarks[0] = StepResult(
        "benchmark",
        BENCHMARKS[0].stem,
        "skipped",
        4.0,
        "needs 2 or more ranks",
        figures={"tables": [], "skipped": "needs 2 or more ranks"},
    )
    return [tests, *lessons, *benchmarks]


def test_without_a_gpu_it_says_so_in_one_line_and_runs_nothing(tmp_path):
    """Run as a user would; CUDA_VISIBLE_DEVICES="" hides any GPU, so this path runs on GPU machines too."""
    environment = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    results, logs = tmp_path / "RESULTS.md", tmp_path / "logs"
    command = [sys.executable, "-m", "gpukit", "gpu-check", "--results", str(results), "--log-dir", str(logs)]
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == gpucheck.EXIT_NO_GPU, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gpu-check: ") and done.stderr.strip().endswith("Nothing was run.")
    assert not results.exists() and not logs.exists()


def test_without_a_gpu_no_step_starts(monkeypatch, tmp_path, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a step ran on a machine without a GPU")

    monkeypatch.setattr(gpucheck, "no_gpu_message", lambda: "gpu-check: no CUDA GPU here. Nothing was run.")
    for name in ("run_tests", "run_lessons", "run_benchmarks", "run_command", "describe_machine", "append_section"):
        monkeypatch.setattr(gpucheck, name, must_not_run)
    assert cli.main(["gpu-check", "--results", str(tmp_path / "R.md")]) == gpucheck.EXIT_NO_GPU
    out, err = capsys.readouterr()
    assert out == "" and err == "gpu-check: no CUDA GPU here. Nothing was run.\n"
    assert cli.main(["gpu-check", "--steps", "tests,lesons"]) == cli.EXIT_BAD_INPUT  # a typo: an error, not a run
    assert "unknown gpu-check step(s) lesons" in capsys.readouterr().err


def test_the_section_has_the_header_versions_and_a_row_per_lesson():
    results = made_up_results()
    section = gpucheck.results_section(MACHINE, results, 1500.0)
    lines = section.splitlines()
    assert lines[0] == "## GPU: NVIDIA H100 80GB HBM3, 2026-11-24 (`make gpu-check`)"
    assert "| NVIDIA H100 80GB HBM3 | 580.159 | 13.0 | 2.11.0+cu130 | 3.12.3 | 0123456789ab | 25 min 0 s |" in lines
    assert f"Failed: tests -m gpu, lesson {LESSONS[1]}." in lines
    assert "| test_train | 4 | 1 | 0 | 0 |" in lines and "| all | 11 | 1 | 0 | 1 |" in lines
    for index, name in enumerate(LESSONS):
        row = f"| {name} | timeout | 300 | stopped after 300 s |" if index == 1 else f"| {name} | pass | {30 + index} |"
        assert sum(line.startswith(row) for line in lines) == 1, row
    assert f"#### `{BENCHMARKS[0].name}`: skipped, 4 s" in lines and "needs 2 or more ranks" in lines
    assert (
        sum(line == f"#### `{path.name}`: pass, 20 s" for line in lines for path in BENCHMARKS[1:])
        == len(BENCHMARKS) - 1
    )
    assert "| model | ms \\| median | ok |" in lines and "| resnet50 | 12.3 | yes |" in lines  # "|" escaped


def test_appending_keeps_earlier_sections(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Measured results\n\n## CPU: 2 cores, 2026-11-23\n\nearlier figures\n")
    first = gpucheck.results_section(MACHINE, made_up_results(), 100.0)
    later = gpucheck.results_section(
        Machine(["NVIDIA H200"], "580.159", "13.0", "2.11.0", "3.12.3", None, "2026-11-25"), made_up_results()[:1], 50.0
    )
    gpucheck.append_section(path, first)
    gpucheck.append_section(path, later)
    text = path.read_text()
    assert text.startswith(
        "# Measured results\n\n## CPU: 2 cores, 2026-11-23\n\nearlier figures\n\n## GPU: NVIDIA H100"
    )
    assert text.index("## GPU: NVIDIA H100") < text.index("## GPU: NVIDIA H200")
    assert text.endswith(later) and first in text
    fresh = tmp_path / "new.md"
    gpucheck.append_section(fresh, later)
    assert fresh.read_text() == "# Measured results\n\n" + later


def test_the_summary_fits_one_screen_and_names_the_failures(tmp_path):
    results = made_up_results()
    text = gpucheck.summary(MACHINE, results, 1500.0, tmp_path / "RESULTS.md", tmp_path / "logs")
    lines = text.splitlines()
    assert len(lines) == len(results) + 4 <= 30 and max(map(len, lines)) <= 160
    assert (
        lines[0] == "gpu-check on NVIDIA H100 80GB HBM3: driver 580.159, CUDA 13.0, torch 2.11.0+cu130, Python 3.12.3"
    )
    assert lines[-1] == f"logs in {tmp_path / 'logs'}"
    assert lines[-3].startswith(f"25 min 0 s in all; FAILED 2 of {len(results)}: tests -m gpu, lesson {LESSONS[1]}")
    assert lines[2].split()[:3] == ["lesson", LESSONS[0], "pass"]
    passed = [result for result in results if result.status != "timeout" and result.kind != "tests"]
    assert "all passed or skipped" in gpucheck.summary(MACHINE, passed, 60.0, None, tmp_path)


def test_the_command_writes_the_section_and_the_summary(monkeypatch, tmp_path, capsys):
    """The whole command with its steps replaced by made-up results: exit code, RESULTS.md and output."""
    results = made_up_results()
    monkeypatch.setattr(gpucheck, "no_gpu_message", lambda: None)
    monkeypatch.setattr(gpucheck, "repository_root", lambda: tmp_path)
    monkeypatch.setattr(gpucheck, "describe_machine", lambda root: MACHINE)
    monkeypatch.setattr(gpucheck, "run_tests", lambda root, logs, seconds: results[0])
    lessons, benchmarks = results[1 : 1 + len(LESSONS)], results[1 + len(LESSONS) :]
    monkeypatch.setattr(gpucheck, "run_lessons", lambda root, logs, seconds, only, report: lessons)
    monkeypatch.setattr(gpucheck, "run_benchmarks", lambda root, logs, seconds, only, report: benchmarks)
    (tmp_path / "benchmarks").mkdir()
    assert cli.main(["gpu-check"]) == gpucheck.EXIT_FAILED
    section = (tmp_path / "benchmarks" / "RESULTS.md").read_text()
    assert "## GPU: NVIDIA H100 80GB HBM3, 2026-11-24" in section and f"| {LESSONS[-1]} | pass |" in section
    out = capsys.readouterr().out
    assert out.splitlines()[-2] == f"section added to {tmp_path / 'benchmarks' / 'RESULTS.md'}"
    assert (tmp_path / "runs" / "gpu-check").is_dir()


def test_steps_run_in_the_order_given_within_the_whole_checks_seconds(monkeypatch, tmp_path):
    """--steps benchmarks,lessons --seconds 100: benchmarks first, each step's limit what is left of the 100 s;
    --only picks lessons and benchmarks by the start of their names, in its order."""
    for folder, name in [("notebooks", "03_m.ipynb"), ("notebooks", "06_b.ipynb"), ("benchmarks", "fit.py")]:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text("")
    monkeypatch.setattr(gpucheck, "no_gpu_message", lambda: None)
    monkeypatch.setattr(gpucheck, "repository_root", lambda: tmp_path)
    monkeypatch.setattr(gpucheck, "describe_machine", lambda root: MACHINE)
    calls, clock = [], [0.0]
    monkeypatch.setattr(gpucheck.time, "monotonic", lambda: clock[0])

    def step(kind):
        def run(root, logs, seconds, only, report):
            calls.append((kind, round(seconds), only))
            clock[0] += 70  # each step spends 70 s
            return []

        return run

    monkeypatch.setattr(gpucheck, "run_lessons", step("lessons"))
    monkeypatch.setattr(gpucheck, "run_benchmarks", step("benchmarks"))
    steps = ["gpu-check", "--steps", "benchmarks,lessons", "--seconds", "100", "--only", "06,03"]
    assert cli.main([*steps, "--results", str(tmp_path / "R.md"), "--log-dir", str(tmp_path / "logs")]) == 0
    assert calls == [("benchmarks", 100, ["06", "03"]), ("lessons", 30, ["06", "03"])]
    found = gpucheck.chosen((tmp_path / "notebooks").glob("*.ipynb"), ["06", "03"])
    assert [path.name for path in found] == ["06_b.ipynb", "03_m.ipynb"]
    assert cli.main(["gpu-check", "--only", "07"]) == cli.EXIT_BAD_INPUT  # no lesson 07 here: said before any step


def test_lessons_fail_once_where_nbval_cannot_be_imported(tmp_path):
    """The check puts its checkout first on PYTHONPATH: an nbval there that fails to import, as without `coverage`."""
    (tmp_path / "nbval").mkdir()
    (tmp_path / "nbval" / "__init__.py").write_text("raise ImportError(\"No module named 'coverage'\")\n")
    reported = []
    results = gpucheck.run_lessons(tmp_path, tmp_path, report=reported.append)
    assert [(r.name, r.status) for r in results] == [("(all)", "fail")] and len(reported) == 1
    assert results[0].detail == "nbval or ipykernel does not import: ImportError: No module named 'coverage'"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended; init reaps it
    except FileNotFoundError:
        return True


def test_a_command_past_its_limit_is_stopped_with_its_children(monkeypatch, tmp_path):
    monkeypatch.setattr(gpucheck, "STOP_GRACE_SECONDS", 0.5)
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)  # only SIGKILL stops this one\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    status, code, seconds = gpucheck.run_command(
        [sys.executable, "-c", script], cwd=tmp_path, environment=dict(os.environ), seconds=4, log=tmp_path / "log"
    )  # 4 s: two Pythons start, one writes and prints, on a machine other jobs may load
    assert (status, code) == ("timeout", None) and 4 <= seconds < time.monotonic() - started + 0.1 < 15
    assert (tmp_path / "log").read_text() == "started\n"
    parent, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 5
    while not (_gone(parent) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(parent) and _gone(child)


def test_a_command_that_ends_reports_its_exit_code(tmp_path):
    run = dict(cwd=tmp_path, environment=dict(os.environ), seconds=30, log=tmp_path / "log")
    assert gpucheck.run_command([sys.executable, "-c", "print('hi')"], **run)[:2] == ("pass", 0)
    assert gpucheck.run_command([sys.executable, "-c", "raise SystemExit('out of memory')"], **run)[:2] == ("fail", 1)
    assert gpucheck.last_line(tmp_path / "log") == "out of memory"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_memory" name="test_a" />
<testcase classname="tests.test_memory.TestPeak" name="test_b"><skipped message="needs a CUDA GPU" /></testcase>
<testcase classname="tests.test_train" name="test_c"><failure message="AssertionError: loss rose&#10;assert 2 &lt; 1">
&gt;   assert loss_after &lt; loss_before, "loss rose"
E   AssertionError: loss rose
E   assert 2 &lt; 1

tests/test_train.py:9: AssertionError</failure></testcase>
<testcase classname="notebooks.03_memory.ipynb" name="Cell 7"><failure message="cut">#x1B[94mCell 7: Timeout of 240 seconds exceeded executing cell
#x1B[31mKeyboardInterrupt#x1B[39m                         Traceback (most recent call last)
#x1B[31mKeyboardInterrupt#x1B[39m: </failure></testcase>
<testcase classname="tests.test_train" name="test_d"><error message="fixture failed">RuntimeError: CUDA error: out of memory</error></testcase>
</testsuite></testsuites>"""


def test_junit_counts_per_file_and_the_line_that_says_what_failed(tmp_path):
    path = tmp_path / "tests.xml"
    path.write_text(JUNIT)
    counts = gpucheck.junit_counts(path)
    assert counts["test_memory"] == Counter(passed=1, skipped=1)
    assert counts["test_train"] == Counter(failed=1, errors=1)
    assert counts["notebooks.03_memory.ipynb"] == Counter(failed=1)
    assert gpucheck.first_failure(path) == "test_c: AssertionError: loss rose"
    assert gpucheck.describe_counts(sum(counts.values(), Counter())) == "1 passed, 2 failed, 1 errors, 1 skipped"
    cell = JUNIT[
        JUNIT.index("#x1B[94mCell 7") : JUNIT.index(
            '</failure></testcase>\n<testcase classname="tests.test_train" name="test_d"'
        )
    ]
    assert gpucheck.failure_line(cell) == "Timeout of 240 seconds exceeded executing cell (KeyboardInterrupt)"
    assert (
        gpucheck.junit_counts(tmp_path / "missing.xml") == {} and gpucheck.first_failure(tmp_path / "missing.xml") == ""
    )


def test_a_benchmark_result_comes_from_its_json(tmp_path):
    log, figures = tmp_path / "b.log", tmp_path / "b.json"
    log.write_text("Traceback …\ntorch.OutOfMemoryError: CUDA out of memory\n")
    assert (
        gpucheck._benchmark_result("b", "fail", 3.0, 180, figures, log).detail
        == "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert gpucheck._benchmark_result("b", "pass", 3.0, 180, figures, log).status == "fail"  # no --json file
    figures.write_text(json.dumps({"tables": [], "skipped": "needs 2 or more ranks"}))
    skipped = gpucheck._benchmark_result("b", "pass", 3.0, 180, figures, log)
    assert (skipped.status, skipped.detail, skipped.failed) == ("skipped", "needs 2 or more ranks", False)
    figures.write_text(json.dumps({"tables": [{"title": "t", "columns": ["a"], "rows": [{"a": 1}, {"a": 2}]}]}))
    assert gpucheck._benchmark_result("b", "pass", 3.0, 180, figures, log).detail == "1 table(s), 2 rows"


@pytest.mark.parametrize("script", BENCHMARKS, ids=[path.stem for path in BENCHMARKS])
def test_every_benchmark_accepts_device_cuda_and_json(script, monkeypatch, capsys):
    """Parse the command gpu-check runs (with --help last, so nothing is measured): a bad option exits 2."""
    monkeypatch.syspath_prepend(str(script.parent))  # run as scripts, a benchmark imports its neighbours
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    command = gpucheck.benchmark_command(script, Path("figures.json"))
    assert command[2:6] == ["--device", "cuda", "--json", "figures.json"]
    monkeypatch.setattr(sys, "argv", [str(script), *command[2:], "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0 and "--json PATH" in capsys.readouterr().out


def test_scaling_benchmarks_skip_below_two_ranks(monkeypatch):
    for gpus, expected in ((0, True), (1, True), (2, False)):
        monkeypatch.setattr(scaling, "detect", lambda gpus=gpus: type("Env", (), {"gpu_count": gpus})())
        backend, skipped = scaling.benchmark_backend("cuda")
        assert backend == "nccl" and bool(skipped) == expected
        assert scaling.benchmark_backend(None) == ("nccl" if gpus else "gloo", skipped if gpus else None)
    assert scaling.benchmark_backend("cpu") == ("gloo", None)
    assert scaling.benchmark_backend("cpu", nprocs=1)[1] == "needs 2 or more ranks, and nprocs=1"
    with pytest.raises(ValueError, match="device cpu runs over gloo, not backend nccl"):
        scaling.benchmark_backend("cpu", "nccl")


def test_a_test_file_that_cannot_be_imported_is_told_apart_from_a_failing_test(tmp_path):
    """A tiny pytest run of gpu-check's tests step in a folder made here: one file imports a module that is not
    installed (as tests/test_site.py without nbconvert did), one has a gpu test that fails."""
    (tmp_path / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'gpu: x')\n"
    )
    (tmp_path / "test_broken.py").write_text("import not_installed_anywhere\n")
    gpu_test = "import pytest\n\n@pytest.mark.gpu\ndef test_{0}():\n    assert {1}\n"
    (tmp_path / "test_fails.py").write_text(
        gpu_test.format("one", "1 == 2, 'loss rose'") + gpu_test.format("two", "True")
    )
    (tmp_path / "test_passes.py").write_text(gpu_test.format("three", "True"))
    logs = tmp_path / "logs"
    logs.mkdir()
    broken = gpucheck.run_tests(tmp_path, logs, 120, files=["test_broken.py", "test_passes.py"])
    assert broken.status == "uncollected" and not broken.failed and broken.uncollected
    assert broken.counts == {"test_broken": Counter(uncollected=1), "test_passes": Counter(passed=1)}
    assert "not_installed_anywhere" in broken.detail
    failing = gpucheck.run_tests(tmp_path, logs, 120, files=["test_fails.py"])
    assert failing.status == "fail" and failing.failed and not failing.uncollected
    assert failing.detail == "1 passed, 1 failed; first: test_one: AssertionError: loss rose"
    assert gpucheck.exit_code([broken]) == gpucheck.EXIT_UNCOLLECTED
    assert gpucheck.exit_code([broken, failing]) == gpucheck.EXIT_FAILED
    assert gpucheck.verdict([broken, failing]) == "FAILED 1 of 2: tests test_fails; NOT COLLECTED: test_broken"
    section = gpucheck.results_section(MACHINE, [broken], 10.0)
    assert "Could not be collected (a module they import is missing): test_broken." in section.splitlines()
    assert "Everything that ran passed." in section.splitlines()
