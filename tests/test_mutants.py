"""Lesson mutation testing (tests/mutants.py, tests/mutations.py): each mutant makes its gpukit measurement wrong
by its factor where lessons call it (gk.…), is undone, and a run is classified honestly: a tautology survives, a
real check kills, a notebook that never calls the function is not applicable, another exception is a crash."""

import contextlib
import dataclasses
import functools
import itertools
import math
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import DeviceType

import gpukit as gk
import gpukit.hardware.contention
from tests import mutants
from tests.mutations import KINDS, KNOWN_SURVIVORS, MUTANTS, RECORD, CallLog, Calls, Known, apply, family, undo

LESSON_DIR = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def applied():
    """apply(name) for the test, undone after it; returns the CallLog of what it noted."""
    patches, log = [], CallLog()

    def apply_one(name: str) -> CallLog:
        patches.extend(apply(name, log))
        return log

    yield apply_one
    undo(patches)


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 2, 2, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def one_second():
    """A clock whose every reading is 1 s after the last: every timed call takes 1 s, whatever the load."""
    return itertools.count().__next__


def measured(name: str, measure, applied) -> tuple[object, object, CallLog]:
    """(the true result, the mutant's result, its log): `measure` called before and after apply(name)."""
    torch.manual_seed(0)
    true = measure()
    log = applied(name)
    torch.manual_seed(0)
    return true, measure(), log


def test_every_mutant_names_a_target_that_exists():
    for mutant in MUTANTS.values():
        module, _, path = mutant.target.partition(":")
        holder = __import__(module, fromlist=["_"])
        for part in path.split("."):
            holder = getattr(holder, part)  # raises where a rename left the mutant pointing at nothing


def test_every_mutant_has_its_inverse_and_says_its_factor():
    for name in {mutant.family for mutant in MUTANTS.values()}:
        pair = [MUTANTS[each] for each in family(name)]
        assert sorted(mutant.direction for mutant in pair) == ["down", "up"], name
        if pair[0].factor is not None:
            assert pair[0].factor * pair[1].factor == pytest.approx(1.0), name
            for mutant in pair:
                label = mutant.name.rpartition("_x")[2]
                assert float(label) == pytest.approx(mutant.factor, rel=0.01) and f"×{label}" in mutant.what, mutant


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone (what a launched worker has, with one rank)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def allreduce_row() -> dict:
    # Every timed call takes 1 s by a clock of its own, so both runs read the same seconds.
    timed = functools.partial(gk.bench.timeit, clock=one_second())
    with one_rank_group(), mock.patch.object(gk.distributed.scaling, "timeit", timed):
        return gk.distributed.scaling.allreduce_benchmark([1024], repeats=2, warmup=0)[0]


def rapl_energy() -> gk.hardware.monitor.Segment:
    """A lap of a CPU monitor over fake RAPL counters: 3 J between start and lap."""
    with tempfile.TemporaryDirectory(prefix="gpukit-test-rapl-") as root:
        zone = Path(root) / "intel-rapl:0"
        zone.mkdir()
        (zone / "max_energy_range_uj").write_text("1000000000\n")
        (zone / "energy_uj").write_text("1000000\n")
        monitor = gk.hardware.Monitor("cpu", rapl_root=root).start()
        (zone / "energy_uj").write_text("4000000\n")
        segment = monitor.lap()
        monitor.close()
        return segment


def history() -> gk.History:
    steps = [{"samples_per_second": 100.0, "tokens_per_second": 800.0, "step_time": 0.1}] * 3
    return gk.History(steps=steps, sample_name="image")


def contention():
    """gk.hardware.measure_contention with its two workers' results made up (launching them takes seconds)."""
    made_up = [{"alone": 100.0, "shared": 50.0, "alone cpu": 1.0, "shared cpu": 0.5}] * 2
    with mock.patch.object(gpukit.hardware.contention, "launch", lambda *args, **kwargs: made_up):
        return gk.hardware.measure_contention(lambda: None, lambda: None, device="cpu")


def logged_losses() -> gk.History:
    train, _ = gk.data.shapes(32, 0, seed=0)
    return gk.fit(gk.models.fast_cnn(4), train, batch_size=16, max_steps=2, log_every=1, device="cpu", progress=False)


def plan_row():
    # plan() looks _row up in its module for each GPU: the wrapped one (a whole plan takes ~20 s here).
    planning = gk.hardware.planning
    work = {"flops": 10**12, "traffic": 10**9, "kernels": 100, "mfu": 0.5, "steps": 1000}
    return planning._row(planning.get_gpu("H100 SXM"), 10**10, 10**9, 64, 2.0, "bf16-mixed", **work)


def timed_twice() -> tuple:
    clock = one_second()
    return tuple(gk.bench.timeit(lambda: None, device="cpu", warmup=0, repeats=2, clock=clock) for _ in "ab")


def compared() -> dict:
    return gk.bench.compare({"a": lambda: None, "b": lambda: None}, warmup=0, repeats=2, clock=one_second())


def a_trace() -> gk.data.timeline.Trace:
    # trace_steps with the profiler's events made up: a 2 ms wait at 1 ms and a 5 ms step at 3 ms (host events, µs).
    events = [
        SimpleNamespace(name=name, device_type=DeviceType.CPU, time_range=SimpleNamespace(start=start, end=end))
        for name, start, end in (("data wait", 1000, 3000), ("step", 3000, 8000))
    ]
    for event in events:
        event.time_range.elapsed_us = lambda range=event.time_range: range.end - range.start
    profiled = SimpleNamespace(events=lambda: events, export_chrome_trace=lambda path: None)
    with mock.patch.object(gk.data.timeline, "profile", lambda **_: contextlib.nullcontext(profiled)):
        return gk.data.trace_steps([tiny_batch()] * 3, tiny_model(), steps=1, device="cpu")


def a_diagnosis() -> gk.data.Diagnosis:
    # Every reading of the clock 1 s after the last: the same rates in every run, whatever the load.
    with mock.patch("time.perf_counter", one_second()):
        return gk.data.diagnose([tiny_batch()] * 2, tiny_model(), steps=2, warmup=1, device="cpu")


def a_decode_table() -> gk.report.Table:
    # Four 32x32 JPEGs decoded in this process (num_workers=0: no worker rows), every pass 1 s by the clock.
    jpegs = gk.data.decoding.photo_jpegs(tiny_batch()[0][:4].clamp(0, 1).mul(255).to(torch.uint8), 32)
    return gk.data.decode_table(jpegs, size=24, batch_size=2, num_workers=0, gpu=False, repeats=1, clock=one_second())


def a_warm_read() -> dict:
    # Four 2x2 images as files, read warm, the read 1 s by the clock.
    images = tiny_batch()[0].clamp(0, 1).mul(255).to(torch.uint8)
    with tempfile.TemporaryDirectory(prefix="gpukit-test-read-") as root:
        store = gk.data.FileImages(
            gk.data.write_files(gk.data.ImageDataset(images, torch.arange(4) % 2, ["a", "b"]), root)
        )
        return gk.data.read_throughput(store, cold=False, clock=one_second())


PARTS = ("params", "grads", "optimizer_state", "activations", "total")
# family -> (what to measure, the numbers in it that its mutants scale by their factor). Calls outside the
# numbers read stay true: tested below for the every-second-call, first-contender and estimate mutants.
MEASURES = {
    "timeit": (
        lambda: gk.bench.timeit(lambda: None, device="cpu", warmup=0, repeats=2, clock=one_second()),
        lambda timing: timing.times,
    ),
    "timeit_second": (timed_twice, lambda timings: timings[1].times),
    "compare_first": (compared, lambda timings: timings["a"].times),
    "timing_median": (lambda: gk.bench.Timing([1.0, 2.0, 3.0]).median, lambda median: [median]),
    "matmul_tflops": (lambda: gk.bench.matmul_tflops("cpu", "fp32", 8, repeats=1, clock=one_second()), lambda r: [r]),
    "flops_per_step": (lambda: gk.bench.flops_per_step(tiny_model(), tiny_batch()), lambda flops: [flops]),
    "mfu": (lambda: gk.bench.mfu(1e12, 0.5, 4.0), lambda mfu: [mfu]),
    "estimate_activations": (lambda: gk.memory.estimate(tiny_model(), tiny_batch()), lambda m: [m.activations]),
    "saved_bytes": (lambda: gk.memory.saved_bytes(tiny_model(), tiny_batch(), device="cpu"), lambda b: [b]),
    "breakdown_parts": (
        lambda: gk.memory.breakdown(tiny_model(), tiny_batch(), device="cpu"),
        lambda memory: [getattr(memory, part) for part in PARTS],
    ),
    "optimizer_state_bytes": (lambda: gk.memory.optimizer_state_bytes(tiny_model(), "adamw"), lambda b: [b]),
    "history_throughput": (history, lambda h: [h.samples_per_second, h.images_per_second]),
    "history_tokens": (history, lambda h: [h.tokens_per_second]),
    "history_loss": (logged_losses, lambda h: [row["loss"] for row in h.steps]),
    "ring_allreduce_time": (lambda: gk.distributed.costmodel.ring_allreduce_time(1e6, 4, 1e9, 1e-5), lambda s: [s]),
    "ring_traffic": (lambda: gk.distributed.scaling.ring_traffic(4), lambda factor: [factor]),
    # seconds × factor, so the algorithm bandwidth (bytes / seconds) ÷ factor; one rank has no bus bandwidth
    "allreduce_benchmark": (allreduce_row, lambda row: [row["seconds"], 1 / row["algorithm_GBps"]]),
    "plan_step_time": (plan_row, lambda row: [row.step_time, row.hours, row.cost]),
    "monitor_energy": (rapl_energy, lambda segment: [segment.energy_j]),
    "contention_shared": (contention, lambda result: result.shared),
    "trace_steps": (a_trace, lambda trace: [trace.total("data wait"), trace.total("step")]),
    "read_throughput": (
        a_warm_read,
        lambda read: [read["samples_per_second"], read["megabytes_per_second"], 1 / read["seconds"]],
    ),
    # the rows timed in this process by the clock given (the per-image row, with no workers, by the wall clock)
    "decode_table": (
        a_decode_table,
        lambda table: [row["images_per_second"] for row in table.rows[:2] + table.rows[6:7]],
    ),
    "diagnose_loader": (a_diagnosis, lambda diagnosis: [diagnosis.loader_steps_per_second]),
    "diagnose_step": (a_diagnosis, lambda diagnosis: [diagnosis.step_steps_per_second]),
}


@pytest.mark.parametrize("name", [name for name, mutant in MUTANTS.items() if mutant.factor is not None])
def test_a_number_is_made_wrong_by_its_factor_where_lessons_call_it(name, applied):
    measure, numbers = MEASURES[MUTANTS[name].family]
    # Read before the mutant is applied: a History's throughput is a property, read when asked.
    true, wrong, log = measured(name, lambda: numbers(measure()), applied)
    assert all(true), (name, true)  # a zero would pass any factor
    factor = MUTANTS[name].factor
    assert wrong == pytest.approx([factor * number for number in true], rel=0.01, abs=1e-12)
    assert f"changed {name}" in log.lines


def test_the_patch_is_undone(applied):
    true = gk.bench.flops_per_step(tiny_model(), tiny_batch())
    patches = apply("flops_per_step_x2", CallLog())
    assert gk.bench.flops_per_step(tiny_model(), tiny_batch()) == 2 * true
    undo(patches)
    assert gk.bench.flops_per_step(tiny_model(), tiny_batch()) == true
    assert gk.memory.estimate is gk.memory.prediction.estimate  # untouched by another mutant's patch
    lap = vars(gk.hardware.Monitor)["lap"]
    undo(apply("monitor_energy_x1000", CallLog()))  # a method: patched on its class, and put back there
    assert vars(gk.hardware.Monitor)["lap"] is lap


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_timeit_mutants_change_every_second_call_or_the_first_contender_alone(factor, applied):
    label = "2" if factor == 2 else "0.5"
    applied(f"timeit_second_x{label}")
    assert [timing.median for timing in timed_twice()] == [1.0, factor]
    applied(f"compare_first_x{label}")  # on top: compare's own timeit calls alternate, the first contender changes
    timings = compared()
    assert timings["a"].times == [factor, factor] and timings["b"].times == [factor, factor], timings


@pytest.mark.parametrize("name", family("estimate_activations"))
def test_estimate_mutants_move_the_peak_by_the_activations_bytes(name, applied):
    true, wrong, _ = measured(name, MEASURES["estimate_activations"][0], applied)
    assert wrong.total - true.total == wrong.activations - true.activations != 0


def test_allreduce_benchmark_mutants_move_both_bandwidths_with_the_time():
    row = {"bytes": 4096, "seconds": 2.0, "algorithm_GBps": 4.0, "bus_GBps": 6.0}
    assert MUTANTS["allreduce_benchmark_x2"].change([row], 0) == [
        {**row, "seconds": 4.0, "algorithm_GBps": 2.0, "bus_GBps": 3.0}
    ]
    assert MUTANTS["allreduce_benchmark_x0.5"].change([row], 0)[0]["bus_GBps"] == 12.0


def test_energy_mutants_move_the_power_where_it_is_computed_from_the_energy(applied):
    applied("monitor_energy_x1000")
    segment = rapl_energy()  # RAPL: mean power = energy / seconds, both wrong alike
    assert segment.energy_j == pytest.approx(3000.0) and segment.mean_power_w * segment.seconds == pytest.approx(3000.0)
    nvml = gk.hardware.monitor.Segment(seconds=2.0, energy_j=500.0, energy_source="energy counter", mean_power_w=250.0)
    wrong = MUTANTS["monitor_energy_x0.001"].change(nvml, 0)  # NVML samples the power apart: it stays
    assert (wrong.energy_j, wrong.mean_power_w) == (pytest.approx(0.5), 250.0)
    no_energy = gk.hardware.monitor.Segment(seconds=2.0)  # a CPU without RAPL: nothing to make wrong
    assert MUTANTS["monitor_energy_x1000"].change(no_energy, 0) == no_energy


@pytest.mark.parametrize("name, says", [("detect_bf16", True), ("detect_no_bf16", False)])
def test_detect_mutants(name, says, applied):
    true = gk.detect()
    assert MUTANTS[name].change(dataclasses.replace(true, bf16=not says), 0).bf16 is says
    log = applied(name)
    assert gk.detect().bf16 is says
    # A CPU's autocast has bf16 already: there detect_bf16 changes nothing, and the log must not say it did.
    assert ("changed " + name in log.lines) == (true.bf16 is not says)


def test_every_known_survivor_names_a_mutant_and_where_it_is_killed():
    for (lesson, name, kind), known in KNOWN_SURVIVORS.items():
        assert name in MUTANTS and kind in KINDS and re.fullmatch(r"\d\d[a-z]?", lesson), (lesson, name, kind)
        assert list(LESSON_DIR.glob(lesson + "_*.ipynb")), f"no lesson {lesson}"
        assert known.why and "cell" in known.killed_by, (lesson, name, kind)
        machine = known.killed_by.split(":")[0]
        assert "any machine" in machine or "cpu" in machine or "cuda" in machine, known.killed_by


def test_record_wraps_every_target_unchanged_and_notes_calls(applied):
    true = gk.bench.matmul_tflops("cpu", "fp32", 8, repeats=1, warmup=0)
    log = applied(RECORD)
    assert math.isfinite(gk.bench.matmul_tflops("cpu", "fp32", 8, repeats=1, warmup=0)) and true > 0
    assert {"called gpukit.bench:matmul_tflops", "called gpukit.bench:timeit"} <= log.lines
    assert not any(line.startswith("changed") for line in log.lines)


def test_a_log_file_is_read_back(tmp_path):
    log = CallLog(tmp_path / "calls.txt")
    for line in ("applied x", "called gpukit.bench:timeit", "changed x", "changed x"):
        log.note(line)
    assert Calls.read(tmp_path / "calls.txt") == Calls({"x"}, {"gpukit.bench:timeit"}, {"x"})
    assert Calls.read(tmp_path / "absent.txt") == Calls()


# ---------------------------------------------------------------------------------------------
# Classifying runs


def executed(*cells: tuple[str, str | None]) -> nbformat.NotebookNode:
    """A notebook as nbclient leaves it: (source, the name of the exception its cell raised, or None)."""
    notebook = nbformat.v4.new_notebook()
    for source, raised in cells:
        outputs = [nbformat.v4.new_output("error", ename=raised, evalue="why", traceback=[])] if raised else []
        notebook.cells.append(nbformat.v4.new_code_cell(source, outputs=outputs))
    return notebook


@pytest.mark.parametrize(
    "cells, stopped, changed, outcome",
    [
        ([("x = 1", None), ("assert x == 2", "AssertionError")], "", True, mutants.KILLED),
        ([("gk.check_between(x, 0.8, 1.25, 'a claim')", "CheckFailed")], "", True, mutants.KILLED),  # gk.check's
        ([("x = f()", "CheckFailed")], "", True, mutants.CRASHED),  # a check helper called outside a check cell
        ([("x = f()", "AssertionError")], "", True, mutants.CRASHED),  # gpukit's own assert, in no check cell
        ([("x = {}[1]", "KeyError")], "", True, mutants.CRASHED),
        ([("x = 1", None)], "CellTimeoutError: cell 0", True, mutants.CRASHED),
        ([("assert x == 2", "AssertionError")], "", False, mutants.CRASHED),  # failed by itself: no kill
        ([("assert x == 1", None)], "", True, mutants.SURVIVED),
        ([("assert x == 1", None)], "", False, mutants.NOT_APPLICABLE),
    ],
)
def test_a_run_is_classified_by_its_first_error_and_what_the_mutant_changed(cells, stopped, changed, outcome):
    calls = Calls({"m"}, {"gpukit.bench:timeit"}, {"m"} if changed else set())
    assert mutants.classify(executed(*cells), stopped, "m", calls)[0] == outcome


def test_a_mutant_not_applied_in_the_kernel_is_a_crash_never_a_survival():
    outcome, detail = mutants.classify(executed(("assert True", None)), "", "m", Calls())
    assert outcome == mutants.CRASHED and "not applied" in detail


def fake_runner(outcomes: dict[str, str], called: set[str], ran: list[str]):
    """A runner that runs nothing: each mutant's outcome from `outcomes`, the baseline's calls `called`."""

    def run(path, mutant, profile):
        ran.append(mutant)
        calls = Calls({mutant}, called, set())
        return mutants.Run(path.stem, mutant, outcomes.get(mutant, "passed"), "cell 3: AssertionError: x", calls=calls)

    return run


def test_a_lesson_that_fails_unmutated_runs_no_mutant(tmp_path):
    ran = []
    runner = fake_runner({RECORD: mutants.BASELINE_FAILED}, set(), ran)
    runs = mutants.run_lesson(tmp_path / "00_x.ipynb", ["timeit_x2", "mfu_x2"], "tiny", runner=runner)
    assert ran == [RECORD] and [run.outcome for run in runs] == [mutants.BASELINE_FAILED] * 2
    assert mutants.failed(runs)


def test_a_mutant_whose_function_the_lesson_never_calls_is_not_applicable_without_a_run(tmp_path, monkeypatch):
    ran = []
    outcomes = {"timeit_x2": mutants.KILLED, "matmul_tflops_x2": mutants.SURVIVED}
    runner = fake_runner(outcomes, {"gpukit.bench:timeit", "gpukit.bench:matmul_tflops"}, ran)
    known = Known("GPU-only", "cuda: lesson 00, cell 29")
    monkeypatch.setitem(mutants.KNOWN_SURVIVORS, ("00", "matmul_tflops_x2", mutants.machine_kind()), known)
    runs = mutants.run_lesson(
        tmp_path / "00_x.ipynb", ["timeit_x2", "mfu_x2", "matmul_tflops_x2"], "tiny", runner=runner
    )
    assert ran == [RECORD, "timeit_x2", "matmul_tflops_x2"]
    assert [run.outcome for run in runs] == [mutants.KILLED, mutants.NOT_APPLICABLE, mutants.KNOWN]
    assert not mutants.failed(runs)
    text = mutants.table(runs)
    assert (
        "score: 1 killed of 2 applicable (50%)" in text
        and "00_x × matmul_tflops_x2: survived (known): GPU-only; killed by cuda: lesson 00, cell 29" in text
    )


def test_the_table_shows_both_directions_of_each_mutant_per_lesson_and_the_load():
    runs = [
        mutants.Run("00_x", "timeit_x2", mutants.KILLED, "cell 3: AssertionError: x", load=(2.0, 3.5)),
        mutants.Run("00_x", "timeit_x0.5", mutants.SURVIVED, load=(3.0, 4.0)),
        mutants.Run("01_y", "timeit_x0.5", mutants.KILLED, "cell 5: AssertionError: y", load=(6.0, 5.0)),
        mutants.Run("01_y", "timeit_x2", mutants.NOT_APPLICABLE, "its function was not called unmutated"),
    ]
    lines = mutants.table(runs, load=(2.0, 5.0)).splitlines()
    assert lines[0] == "load average (1 min): 2.0 at the start, 5.0 at the end"
    assert lines[1].split() == ["mutant", "direction", "00", "01"]
    assert lines[2].split() == ["timeit", "up", "×2", "killed", "n/a"]  # up first, whatever order the runs came in
    assert lines[3].split() == ["down", "×0.5", "SURVIVED", "killed"]  # the family named once
    assert lines[4].split() == ["load", "(1", "min)", "2.0-4.0", "5.0-6.0"]
    text = "\n".join(lines)
    assert "score (up): 1 killed of 1 applicable (100%)" in text and "score (down): 1 killed of 2 applicable" in text
    assert "score: 2 killed of 3 applicable (67%)" in text


def test_mutants_are_chosen_by_name_or_family_and_direction():
    assert mutants.chosen_mutants(["timeit", "mfu_x2"], "both") == ["timeit_x2", "timeit_x0.5", "mfu_x2"]
    assert mutants.chosen_mutants(["timeit", "mfu_x2"], "down") == ["timeit_x0.5"]
    assert mutants.chosen_mutants(None, "up") == [name for name, m in MUTANTS.items() if m.direction == "up"]
    with pytest.raises(ValueError, match="unknown mutants matmul_x3"):
        mutants.chosen_mutants(["matmul_x3"], "both")


def test_the_command_line_refuses_an_unknown_mutant_or_lesson_before_running_anything(capsys):
    with pytest.raises(SystemExit):
        mutants.main(["--lessons", "00", "--mutants", "matmul_x3"])
    assert "unknown mutants matmul_x3" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--lessons 99"):
        mutants.main(["--lessons", "99", "--mutants", "timeit_x2"])


# ---------------------------------------------------------------------------------------------
# Real kernels: the mechanism end to end on tiny notebooks made here

SETUP = "import torch\nimport gpukit as gk\n\nmodel, inputs = torch.nn.Linear(8, 16), torch.ones(4, 8)"
NOTEBOOKS = {
    # The count checked against itself: both sides move together, so no mutant can make it fail.
    "tautology": "flops = gk.bench.flops_per_step(model, inputs, backward=False)\n"
    "assert flops == gk.bench.flops_per_step(model, inputs, backward=False)",
    # The count against its value worked out by hand: 2 FLOPs per multiply-add, batch × in × out of them.
    "real_check": "assert gk.bench.flops_per_step(model, inputs, backward=False) == 2 * 4 * 8 * 16",
    "never_calls": "assert sum(parameter.numel() for parameter in model.parameters()) == 8 * 16 + 16",
    "crash": "layer_of = {1024: 'linear'}\nprint(layer_of[gk.bench.flops_per_step(model, inputs, backward=False)])",
}


@pytest.mark.slow
def test_the_mechanism_in_real_kernels(tmp_path):
    # Four kernels: about 6 s each on an idle 2-core machine, 25 s at a load of 10.
    paths = {}
    for name, cell in NOTEBOOKS.items():
        paths[name] = tmp_path / f"{name}.ipynb"
        cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(cell)]
        nbformat.write(nbformat.v4.new_notebook(cells=cells), paths[name])
    runs = {
        name: mutants.run_lesson(paths[name], ["flops_per_step_x2"], "tiny", baseline=False)[0]
        for name in ("tautology", "real_check", "crash")
    }
    outcomes = {name: run.outcome for name, run in runs.items()}
    assert outcomes == {"tautology": mutants.SURVIVED, "real_check": mutants.KILLED, "crash": mutants.CRASHED}, runs
    assert runs["real_check"].detail.startswith("cell 1: AssertionError") and "KeyError" in runs["crash"].detail
    # The unmutated run first: it passes and records no call of flops_per_step, so the mutant is not run.
    never = mutants.run_lesson(paths["never_calls"], ["flops_per_step_x2"], "tiny")[0]
    assert (never.outcome, never.seconds) == (mutants.NOT_APPLICABLE, 0.0), never


WORKERS = """from gpukit.distributed import scaling

def worker():
    gk.distributed.setup("gloo")
    return scaling.allreduce_benchmark([1024], repeats=1, warmup=0)[0]["seconds"]

seconds = gk.distributed.launch(worker, 2, backend="gloo", timeout=240)"""


@pytest.mark.slow
def test_a_mutant_reaches_launched_workers_and_their_calls_are_noted(tmp_path):
    # The all-reduce benchmark runs only in worker processes (spawned, as lesson 04 launches them): they start with
    # the kernel's environment, so the mutant is applied in them too and they note their calls in the same file.
    # About 30 s on an idle 2-core machine: a kernel and two workers importing torch.
    path = tmp_path / "workers.ipynb"
    cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(WORKERS)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    run = mutants.run_one(path, "allreduce_benchmark_x2", "tiny", cell_seconds=300)
    assert run.outcome == mutants.SURVIVED, run  # nothing checks it here: the notebook ran, the mutant changed a row
    assert "gpukit.distributed.scaling:allreduce_benchmark" in run.calls.called
    assert run.load is not None and all(value >= 0 for value in run.load)
