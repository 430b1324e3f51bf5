"""Time every lesson in one profile on this machine: `python tools/lesson_times.py --profile cpu`.

Each lesson runs under nbval (`--nbval-lax --nbval-current-env`) in its own pytest and kernel, with
GPUKIT_PROFILE set, as `make test` runs them in `tiny`. For each lesson it prints the result, the wall time,
the load average before and after (other jobs on the machine slow a lesson down: read the times with it) and
its slowest cells, and how many lines it printed that start with "skipped:"; at the end, a Markdown table for
benchmarks/RESULTS.md. Logs, JUnit files and the executed lessons (notebooks/, with their outputs) go to
runs/lesson-times/<date-time>/ (ignored by git).

    python tools/lesson_times.py --profile cpu                 # every lesson, laptop sizes
    python tools/lesson_times.py --profile cpu --only 01 06    # lessons whose names start with 01 or 06
    python tools/lesson_times.py --profile tiny --busy 2       # CI's normal state: two busy processes beside it
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from gpukit.gpucheck import child_environment, chosen, first_failure, lesson_command, markdown_table, run_command

ROOT = Path(__file__).resolve().parents[1]


def cell_times(junit: Path) -> list[tuple[str, float]]:
    """(cell name, seconds) for every cell nbval ran, from pytest's JUnit file; [] if it wrote none."""
    if not junit.exists():
        return []
    return [(case.get("name", "?"), float(case.get("time", 0))) for case in ElementTree.parse(junit).iter("testcase")]


def skipped_lines(executed: Path) -> list[str]:
    """The lines an executed lesson printed that start with "skipped:" (a check not made here, and why)."""
    if not executed.exists():
        return []
    cells = json.loads(executed.read_text())["cells"]
    texts = ["".join(output.get("text", "")) for cell in cells for output in cell.get("outputs", [])]
    return [line.strip() for text in texts for line in text.splitlines() if line.strip().startswith("skipped:")]


def time_lesson(notebook: Path, profile: str, logs: Path, cell_seconds: int, lesson_seconds: int) -> dict:
    junit = logs / f"{notebook.stem}.xml"
    command = lesson_command(notebook, junit, logs / "notebooks", cell_seconds, cell_seconds)
    load_before = os.getloadavg()[0]
    status, _, seconds = run_command(
        command, cwd=ROOT, environment=child_environment(ROOT, GPUKIT_PROFILE=profile), seconds=lesson_seconds,
        log=logs / f"{notebook.stem}.log",
    )  # fmt: skip
    cells = sorted(cell_times(junit), key=lambda cell: -cell[1])
    slowest = ", ".join(f"{name.replace('Cell ', 'cell ')} {time:.0f} s" for name, time in cells[:3])
    return {
        "lesson": notebook.stem, "result": status, "seconds": round(seconds),
        "load before": f"{load_before:.1f}", "load after": f"{os.getloadavg()[0]:.1f}",
        "checks skipped": len(skipped_lines(logs / "notebooks" / notebook.name)),
        "slowest cells": slowest if status == "pass" else first_failure(junit) or slowest,
    }  # fmt: skip


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes that spin on a core each for as long as the block runs: the load CI's other jobs put on the
    machine, so that a timing check that only holds on a quiet machine fails here first."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="cpu", choices=("tiny", "cpu", "gpu"))
    parser.add_argument("--only", nargs="+", metavar="PREFIX", help="lessons whose names start with these")
    parser.add_argument("--cell-seconds", type=int, default=900, help="nbval's limit for one cell")
    parser.add_argument("--lesson-seconds", type=int, default=1800, help="a lesson is stopped after this")
    parser.add_argument("--busy", type=int, default=0, metavar="N", help="N busy processes beside each lesson")
    args = parser.parse_args(argv)
    logs = ROOT / "runs" / "lesson-times" / datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    logs.mkdir(parents=True)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"Python {platform.python_version()}, profile {args.profile}, {args.busy} busy process(es) beside it; "
          f"logs in {logs}", flush=True)  # fmt: skip
    rows = []
    with busy_processes(args.busy):
        for notebook in chosen((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"), args.only):
            rows.append(time_lesson(notebook, args.profile, logs, args.cell_seconds, args.lesson_seconds))
            print(rows[-1], flush=True)
    print("\n".join(markdown_table(list(rows[0]), rows)) if rows else "no lesson matched")
    return 0 if all(row["result"] == "pass" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
