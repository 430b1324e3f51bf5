"""Lesson mutation testing (tests/mutants.py, tests/mutations.py): each mutant makes its gpukit measurement wrong
by its factor where lessons call it (gk.…), is undone, and a run is classified honestly: a tautology survives, a
real check kills, a notebook that never calls the function is not applicable, another exception is a crash."""

import dataclasses
import itertools
import math

import nbformat
import pytest
import torch
from torch import nn

import gpukit as gk
from tests import mutants
from tests.mutations import MUTANTS, RECORD, CallLog, Calls, apply, undo


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


@pytest.mark.parametrize(
    "name, measure, factor",
    [
        ("matmul_tflops_x2", lambda: gk.bench.matmul_tflops("cpu", "fp32", 8, repeats=1, clock=one_second()), 2.0),
        ("flops_per_step_x2", lambda: gk.bench.flops_per_step(tiny_model(), tiny_batch()), 2.0),
        ("mfu_x2", lambda: gk.bench.mfu(1e12, 0.5, 4.0), 2.0),
        ("saved_bytes_x1.5", lambda: gk.memory.saved_bytes(tiny_model(), tiny_batch(), device="cpu"), 1.5),
        ("optimizer_state_bytes_x1.5", lambda: gk.memory.optimizer_state_bytes(tiny_model(), "adamw"), 1.5),
        ("allreduce_x2", lambda: gk.distributed.costmodel.ring_allreduce_time(1e6, 4, 1e9, 1e-5), 2.0),
        ("timing_median_x2", lambda: gk.bench.Timing([1.0, 2.0, 3.0]).median, 2.0),
    ],
)
def test_a_number_is_made_wrong_by_its_factor_where_lessons_call_it(name, measure, factor, applied):
    true, wrong, log = measured(name, measure, applied)
    assert wrong == pytest.approx(factor * true, rel=0.01), (true, wrong)
    assert f"changed {name}" in log.lines


def test_the_patch_is_undone(applied):
    true = gk.bench.flops_per_step(tiny_model(), tiny_batch())
    patches = apply("flops_per_step_x2", CallLog())
    assert gk.bench.flops_per_step(tiny_model(), tiny_batch()) == 2 * true
    undo(patches)
    assert gk.bench.flops_per_step(tiny_model(), tiny_batch()) == true
    assert gk.memory.estimate is gk.memory.prediction.estimate  # untouched by another mutant's patch


def test_timeit_mutants_slow_all_calls_every_second_call_or_the_first_contender(applied):
    clock = one_second()
    applied("timeit_second_x2")
    first, second = (gk.bench.timeit(lambda: None, device="cpu", warmup=0, repeats=2, clock=clock) for _ in "ab")
    assert (first.median, second.median) == (1.0, 2.0)
    applied("compare_first_x2")  # on top: compare's own timeit calls alternate, the first contender doubles
    timings = gk.bench.compare({"a": lambda: None, "b": lambda: None}, warmup=0, repeats=2, clock=clock)
    assert timings["a"].times == [2.0, 2.0] and timings["b"].times == [2.0, 2.0], timings


def test_memory_mutants_change_the_parts_they_name(applied):
    model, batch = tiny_model(), tiny_batch()
    true, wrong, log = measured("estimate_activations_x1.5", lambda: gk.memory.estimate(model, batch), applied)
    extra = round(true.activations * 0.5)
    assert true.activations > 0 and (wrong.activations, wrong.total) == (true.activations + extra, true.total + extra)
    true, wrong, _ = measured("breakdown_parts_x1.5", lambda: gk.memory.breakdown(model, batch, device="cpu"), applied)
    for part in ("params", "grads", "optimizer_state", "activations", "total"):
        assert getattr(wrong, part) == round(1.5 * getattr(true, part)), part


def test_history_throughput_mutants(applied):
    steps = [{"samples_per_second": 100.0, "tokens_per_second": 800.0, "step_time": 0.1}] * 3
    history = gk.History(steps=steps, sample_name="image")
    applied("history_throughput_x0.5")
    applied("history_tokens_x0.5")
    assert (history.samples_per_second, history.images_per_second, history.tokens_per_second) == (50, 50, 400)


def test_plan_step_time_mutant_slows_each_gpu_row(applied):
    # plan() looks _row up in its module for each GPU: the wrapped one (a whole plan takes ~20 s here).
    planning = gk.hardware.planning
    work = {"flops": 10**12, "traffic": 10**9, "kernels": 100, "mfu": 0.5, "steps": 1000}
    true, wrong, log = measured(
        "plan_step_time_x2",
        lambda: planning._row(planning.get_gpu("H100 SXM"), 10**10, 10**9, 64, 2.0, "bf16-mixed", **work),
        applied,
    )
    assert (wrong.step_time, wrong.hours, wrong.cost) == pytest.approx(
        (2 * true.step_time, 2 * true.hours, 2 * true.cost)
    )


def test_detect_bf16_mutant(applied):
    true = gk.detect()
    assert MUTANTS["detect_bf16"].change(dataclasses.replace(true, bf16=False), 0).bf16 is True
    log = applied("detect_bf16")
    assert gk.detect().bf16 is True
    # A CPU's autocast has bf16 already: there the mutant changes nothing, and the log must not say it did.
    assert ("changed detect_bf16" in log.lines) == (not true.bf16)


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
    monkeypatch.setitem(mutants.KNOWN_SURVIVORS, ("00", "matmul_tflops_x2", mutants.machine_kind()), "GPU-only")
    runs = mutants.run_lesson(
        tmp_path / "00_x.ipynb", ["timeit_x2", "mfu_x2", "matmul_tflops_x2"], "tiny", runner=runner
    )
    assert ran == [RECORD, "timeit_x2", "matmul_tflops_x2"]
    assert [run.outcome for run in runs] == [mutants.KILLED, mutants.NOT_APPLICABLE, mutants.KNOWN]
    assert not mutants.failed(runs)
    text = mutants.table(runs)
    assert (
        "score: 1 killed of 2 applicable (50%)" in text
        and "00_x × matmul_tflops_x2: survived (known): GPU-only" in text
    )


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
