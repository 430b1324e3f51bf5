"""tools/lesson_times.py --busy N: the lessons timed with N busy processes beside them, as CI's shared cores are."""

import importlib.util
import time
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "lesson_times.py"


@pytest.fixture(scope="module")
def lesson_times():
    spec = importlib.util.spec_from_file_location("lesson_times", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spinning_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / 100  # USER_HZ is 100 on Linux


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc: Linux only")
def test_busy_processes_burn_cpu_while_the_block_runs_and_are_gone_after(lesson_times, monkeypatch):
    started = []
    real_popen = lesson_times.subprocess.Popen
    monkeypatch.setattr(
        lesson_times.subprocess, "Popen", lambda *a, **k: started.append(real_popen(*a, **k)) or started[-1]
    )
    with lesson_times.busy_processes(2):
        time.sleep(1.0)
        assert len(started) == 2 and all(process.poll() is None for process in started)
        assert (
            _spinning_seconds([process.pid for process in started]) > 0.05
        )  # they spin (a sleeping one would show 0), even on a machine loaded by others
    assert all(process.poll() is not None for process in started)
