"""Lesson 07's energy check on a CPU with RAPL counters, run here where there are none: its two check cells (the
monitor's columns, and the monitor's mean power against the counters read by hand around a second fit) run in this
process against a fake /sys/class/powercap whose package counter advances at a known power while a real fit trains.
The check passes with the monitor as it is and fails with the monitor's energy 2×, 0.5×, 1,000× or 0.001× off, and
with each column fit derives from it (mean power, joules per image, grams of CO₂) 2× or 0.5× off.
Also its contention check, on results whose slowdown is read 2× or 0.5× off where the direction bounds pass.
"""

from __future__ import annotations

import contextlib
import glob
import io
import math
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gpukit as gk
from gpukit.hardware import monitor as monitor_module
from gpukit.hardware.contention import ContentionResult
from tests.helpers import lesson_cells
from tests.mutations import _energy_scaled

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "07_choosing_and_watching_a_gpu.ipynb"
ENERGY_CELLS = ("cell-17", "rapl-by-hand")  # the monitor's columns; its mean power against the counters by hand
WATTS = 20.0  # the fake package's power
RANGE_UJ = 2**32  # where the fake counter wraps: 4,295 J, about 3.6 minutes at WATTS


class FakePackage:
    """intel-rapl:0 (a package) with a counter that a thread advances at WATTS, and a sub-zone (its cores) that
    counts far faster, which must not be counted again. `near_wrap()`: the counter 2 J below its wrap from now (0.1 s
    at WATTS), so that the next fit wraps it."""

    def __init__(self, root: Path):
        self.zone, self.cores = root / "intel-rapl:0", root / "intel-rapl:0:0"
        for zone in (self.zone, self.cores):
            zone.mkdir(parents=True)
            (zone / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
        self.stop, self.lock = threading.Event(), threading.Lock()  # the lock: one writer at a time (near_wrap, run)
        self.near_wrap()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def near_wrap(self) -> None:
        with self.lock:
            self.start_uj, self.started = RANGE_UJ - 2_000_000, time.perf_counter()
        self.write()

    def write(self) -> None:
        with self.lock:
            microjoules = self.start_uj + round(WATTS * (time.perf_counter() - self.started) * 1e6)
            for zone, uj in ((self.zone, microjoules), (self.cores, 1000 * microjoules)):
                (zone / "energy_uj.new").write_text(f"{uj % RANGE_UJ}\n")
                os.replace(zone / "energy_uj.new", zone / "energy_uj")  # a reader never sees half a number

    def run(self) -> None:
        while not self.stop.wait(0.001):
            self.write()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread, as the lesson's kernel has on a loaded 2-core machine: two spinning OpenMP threads beside other
    load made these fits 30× slower (17 s an epoch against 0.55 s, load 5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def energy_namespace(device: torch.device) -> dict:
    """What the lesson's cells before the check hold: the monitored fit (smaller) and what it was fitted with."""
    train_set, _ = gk.data.shapes(train_size=512, test_size=64, seed=0)
    profile, batch_size = SimpleNamespace(width=4), 64
    gk.seed_everything(0)
    history = gk.fit(
        gk.models.fast_cnn(profile.width),
        train_set,
        epochs=3,
        batch_size=batch_size,
        device=device,
        reporting=gk.Reporting(monitor=True),
        progress=False,
    )
    columns = ["energy_j", "joules_per_sample", "co2_grams", "mean_power_w", "mean_utilization", "throttle_reasons"]
    return {
        "gk": gk,
        "glob": glob,
        "math": math,
        "os": os,
        "time": time,
        "device": device,
        "history": history,
        "profile": profile,
        "train_set": train_set,
        "CNN_BATCH": batch_size,
        "monitored_precision": "fp32",
        "energy_columns": columns,
    }


def run_energy_checks(namespace: dict) -> list[str]:
    """The lesson's two energy check cells run in `namespace`; the lines they printed."""
    cells, printed = lesson_cells(LESSON), io.StringIO()
    with contextlib.redirect_stdout(printed):
        for cell_id in ENERGY_CELLS:
            exec(compile(cells[cell_id], f"{LESSON.name}[{cell_id}]", "exec"), namespace)
    return printed.getvalue().splitlines()


def test_the_energy_check_reads_rapl_by_hand_and_fails_a_monitor_off_either_way(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_module, "RAPL_ROOT", str(tmp_path))
    cpu = torch.device("cpu")
    with FakePackage(tmp_path) as package:
        namespace = energy_namespace(cpu)
        package.near_wrap()  # the counter wraps during the check's own fit: read by hand, and by the monitor
        printed = run_energy_checks(namespace)
        assert len(printed) == 6 and all(line.startswith(("check passed", "skipped")) for line in printed), printed
        assert namespace["after"][0] < namespace["before"][0]  # the counter wrapped between the hand's reads
        # Within 20%: the fake counter's writer is a Python thread that a loaded machine delays (2x off fails).
        assert "read by hand" in printed[2] and namespace["by_hand"] == pytest.approx(WATTS, rel=0.2)
        assert namespace["by_monitor"] == pytest.approx(WATTS, rel=0.2)
        assert namespace["weighted"] == pytest.approx(WATTS, rel=0.2)
        columns = ("mean_power_w", "joules_per_sample", "co2_grams")  # one check passed for each, in this order
        assert all(column in line for column, line in zip(columns, printed[3:], strict=True)), printed
        lap = monitor_module.Monitor.lap
        for factor in (2.0, 0.5, 1000.0, 0.001):  # the lesson's mutants: a unit slip, and 2× either way
            change = _energy_scaled(factor)
            monkeypatch.setattr(monitor_module.Monitor, "lap", lambda self, change=change: change(lap(self), 0))
            package.near_wrap()
            with pytest.raises(gk.CheckFailed, match="read by hand"):
                run_energy_checks(dict(namespace))  # the second fit's monitor is the one made wrong
            monkeypatch.setattr(monitor_module.Monitor, "lap", lap)


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("column", ["mean_power_w", "joules_per_sample", "co2_grams"])
def test_the_energy_check_fails_each_derived_column_off_either_way(tmp_path, monkeypatch, column, factor):
    # The monitor's energy right, one column fit derives from it wrong: the second fit's History, made wrong in that
    # column in every epoch, fails the check on it, by name.
    monkeypatch.setattr(monitor_module, "RAPL_ROOT", str(tmp_path))
    fit = gk.fit

    def wrong_fit(*args, **kwargs):
        history = fit(*args, **kwargs)
        for row in history.epochs:
            row[column] *= factor
        return history

    with FakePackage(tmp_path):
        namespace = energy_namespace(torch.device("cpu"))
        monkeypatch.setattr(gk, "fit", wrong_fit)  # the check cell's own fit, not the one before it
        with pytest.raises(gk.CheckFailed, match=column):
            run_energy_checks(namespace)


def test_without_rapl_the_energy_checks_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_module, "RAPL_ROOT", str(tmp_path / "powercap"))  # missing, as on this machine
    printed = run_energy_checks(energy_namespace(torch.device("cpu")))
    assert printed[0].startswith("check passed") and "nothing is added" in printed[0]
    assert [line.split(":")[0] for line in printed[1:]] == ["skipped", "skipped"], printed


def contention_cell() -> str:
    return next(source for source in lesson_cells(LESSON).values() if "contention.cpu_share_ratio" in source)


@pytest.mark.parametrize(
    ("alone_share", "shared_share", "factor"),
    [(0.34, 0.16, 1.0), (0.34, 0.16, 2.0), (0.5, 0.4, 1.0), (0.5, 0.4, 0.5), (0.34, 0.08, 1.0)],
    ids=["quiet", "quiet, x2", "loaded", "loaded, x0.5", "the core taken by other load"],
)
def test_the_contention_check_holds_each_slowdown_against_cpu_time(alone_share, shared_share, factor):
    # Quiet: each process got a share of the core alone (0.34, as measured at load 5-6) and 0.16 shared, and ran
    # at 0.47 of its speed: read 2× high (0.94) it still passes the direction bounds (below 0.99). Loaded: 0.8 of the
    # share and 0.8 of the speed; read 0.5× (0.4), it too passes them. Only the CPU-time checks catch either. Other
    # load took the shared core from both (0.08 each, 0.24 of their speed, as read at load 5 on 2026-11-29): a floor
    # on the speeds alone (0.35, the lesson's until then) failed a true reading; the CPU shares explain it.
    ratio = shared_share / alone_share * factor
    result = ContentionResult(
        alone=[100.0, 96.0],
        shared=[100.0 * ratio, 96.0 * ratio],
        device="cpu",
        threads=1,
        rounds=3,
        cores=[0],
        alone_cpu_share=[alone_share] * 2,
        shared_cpu_share=[shared_share] * 2,
    )
    namespace = {"gk": gk, "contention": result, "device": torch.device("cpu")}
    failed = contextlib.nullcontext() if factor == 1.0 else pytest.raises(gk.CheckFailed, match="CPU shares'")
    printed = io.StringIO()
    with failed, contextlib.redirect_stdout(printed):
        exec(compile(contention_cell(), "contention check", "exec"), namespace)
    assert printed.getvalue().count("check passed") == (4 if factor == 1.0 else 1)  # 2× off: "sharing costs" passes
