"""gk.hardware: the GPU table, plan (fit, time, cost), the NVML monitor (with a fake NVML), contention."""

from __future__ import annotations

import random
import statistics
import sys
import time
import types

import pytest
import torch

import gpukit as gk
from gpukit.bench import Timing
from gpukit.hardware import (
    GPU,
    GPUS,
    Monitor,
    MonitorUnavailable,
    add_gpu,
    calibration,
    find_gpu,
    get_gpu,
    reset_gpus,
)
from gpukit.hardware.contention import ContentionResult
from gpukit.hardware.monitor import Segment, joules_to_co2_grams
from gpukit.hardware.planning import calibration_sizes
from gpukit.memory.measuring import sample_batch


@pytest.fixture(autouse=True)
def fresh_table():
    yield
    reset_gpus()


# ---------------------------------------------------------------------------------------------
# The table


def test_precision_support_follows_the_compute_capability():
    """Two independent facts per row agree: bf16 tensor cores came with Ampere (8.0), fp8 with Ada
    and Hopper (8.9), tf32 with Ampere; and tensor peaks are at least the plain fp32 rate."""
    for gpu in GPUS.values():
        assert gpu.supports_bf16 == (gpu.compute_capability >= (8, 0)), gpu.name
        assert gpu.supports_fp8 == (gpu.compute_capability >= (8, 9)), gpu.name
        assert (gpu.tf32 is not None) == (gpu.compute_capability >= (8, 0)), gpu.name
        for peak in (gpu.tf32, gpu.bf16, gpu.fp16, gpu.fp8):
            assert peak is None or peak >= gpu.fp32, gpu.name
        if gpu.bf16 is not None:
            assert gpu.bf16 == gpu.fp16, gpu.name
            assert gpu.tf32 == pytest.approx(gpu.bf16 / 2, rel=0.02), gpu.name  # tf32 runs at half the bf16 rate
        if gpu.fp8 is not None:
            assert gpu.fp8 == pytest.approx(2 * gpu.bf16, rel=0.02), gpu.name  # fp8 runs twice as fast


@pytest.mark.parametrize(
    "device_name, row",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 5090", "RTX 5090"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("NVIDIA GeForce RTX 4090 SUPER", None),
    ],
)
def test_driver_names_find_their_row(device_name, row):
    found = find_gpu(device_name)
    assert (found.name if found else None) == row


def test_unknown_gpu_names_the_closest():
    with pytest.raises(ValueError, match=r"no GPU called 'H100 SMX'.*Did you mean 'H100 SXM'"):
        get_gpu("H100 SMX")
    assert get_gpu("h100 sxm") is GPUS["H100 SXM"] is get_gpu("NVIDIA H100 80GB HBM3")


def test_add_gpu_overrides_and_bench_reads_the_same_table():
    before = gk.bench.peak_tflops("NVIDIA A100 80GB PCIe", "bf16-mixed")
    pcie = GPU("A100 80GB PCIe", 80, 1.935, 19.5, 156.0, 300.0, 300.0, None, (8, 0), 300, ("A100 80GB PCIe",))
    add_gpu(pcie)
    assert gk.bench.peak_tflops("NVIDIA A100 80GB PCIe", "bf16-mixed") == 300.0 != before
    assert gk.bench.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == before  # the SXM row is untouched
    add_gpu(GPU("MyGPU", 12, 0.5, 10.0, None, None, 40.0, None, (7, 5), 100))
    assert get_gpu("mygpu").peak_tflops("fp16-mixed") == 40.0
    with pytest.raises(ValueError, match="memory_gb must be positive"):
        add_gpu(GPU("Broken", 0, 0.5, 10.0, None, None, 40.0, None, (7, 5), 100))
    reset_gpus()
    assert "MyGPU" not in GPUS


# ---------------------------------------------------------------------------------------------
# plan


def _cnn_batch():
    torch.manual_seed(0)
    return gk.models.fast_cnn(4), (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))


def _gpt_batch():
    torch.manual_seed(0)
    model = gk.models.gpt(width=32, depth=1, heads=2, max_seq_len=32)
    tokens = torch.randint(0, 256, (8, 33))
    return model, (tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("make", [_cnn_batch, _gpt_batch], ids=["cnn", "gpt"])
def test_plan_memory_largest_batch_and_frontier(make):
    model, batch = make()
    plan = gk.hardware.plan(
        model,
        batch,
        gpus=["T4", "L4", "H100 SXM", "B200"],
        mfu=0.4,
        steps=2000,
        precision="bf16-mixed",
        optimizer="adamw",
        prices={"L4": 2.0},
    )
    independent = gk.memory.estimate(model, batch, device="cuda", precision="bf16-mixed", optimizer="adamw")
    assert plan.memory.total == independent.total
    for row in plan.rows:
        assert row.fits == (independent.total <= row.usable)
    # The largest batch of the smallest GPU, checked by predictions the plan did not make.
    t4 = plan.row("T4")
    at, above = gk.memory.estimate(
        model,
        batch,
        device="cuda",
        precision="bf16-mixed",
        optimizer="adamw",
        batch_sizes=[t4.largest_batch, t4.largest_batch + 1],
    )
    assert at.total <= t4.usable < above.total
    assert plan.row("B200").largest_batch > plan.row("L4").largest_batch > t4.largest_batch
    # T4 has no bf16 tensor cores: no time, no cost, rather than a made-up one.
    assert t4.step_time is None and t4.cost is None
    priced = [row for row in plan.rows if row.cost is not None]
    for row in priced:
        dominated = any(
            o.hours <= row.hours and o.cost <= row.cost and (o.hours, o.cost) != (row.hours, row.cost) for o in priced
        )
        assert row.pareto == (not dominated)
    assert plan.pareto and "Pareto" in str(plan)
    l4 = plan.row("L4")  # time and cost: steps × step time, hours × the price given
    assert l4.price == 2.0 and l4.hours == pytest.approx(l4.step_time * 2000 / 3600)
    assert l4.cost == pytest.approx(l4.hours * 2.0) and "some given by you" in plan.prices_source
    figure = plan.plot()
    assert len(figure.axes[0].collections) == len(priced)


def test_plan_bad_input():
    model, batch = _cnn_batch()
    with pytest.raises(ValueError, match="price of L4 must be a positive"):
        gk.hardware.plan(model, batch, gpus=["L4"], mfu=0.5, prices={"L4": 0})
    with pytest.raises(ValueError, match="Did you mean .*'L40S'"):
        gk.hardware.plan(model, batch, gpus=["L40X"], mfu=0.5)
    with pytest.raises(ValueError, match="mfu must be"):
        gk.hardware.plan(model, batch, gpus=["L4"], mfu=1.5)
    with pytest.raises(ValueError, match="steps must be"):
        gk.hardware.plan(model, batch, gpus=["L4"], mfu=0.5, steps=0)
    # Nothing fits when almost all memory is kept free: say by how much, and what would help.
    with pytest.raises(ValueError, match=r"largest GPU in the table, the H100 SXM.*short.*checkpointing"):
        gk.hardware.plan(model, batch, gpus=["T4", "H100 SXM"], mfu=0.5, margin=0.9999999, precision="fp32")


# ---------------------------------------------------------------------------------------------
# plan's prediction on the machine present: a line through steps timed at two other batch sizes


def test_calibration_sizes_never_time_the_planned_batch():
    for size in range(1, 300):
        small, large = calibration_sizes(size)
        assert 2 <= small < large and size not in (small, large), (size, small, large)
    assert calibration_sizes(64) == (8, 48) and calibration_sizes(16) == (2, 12)
    assert calibration_sizes(3) == (6, 12)  # too small to split: twice and four times it


def _timed_on_a_line(fixed: float, per_example: float, size: int, planned: float):
    """A stand-in for gk.bench.compare: a step of b examples takes fixed + b × per_example seconds, but the
    one at the planned batch `size` takes `planned`, which no prediction may read."""

    def compare(steps, **options):
        assert set(steps) == {size, *calibration_sizes(size)}, list(steps)
        return {b: Timing([planned if b == size else fixed + b * per_example] * 3) for b in steps}

    return compare


def _measure_on_a_test_cpu(monkeypatch, model, batch, fixed: float, per_example: float, planned: float):
    """plan's measurement here (MFU, source, check) with steps timed on a line (see _timed_on_a_line) against a
    peak of 2 TFLOP/s, and a count of 1 GFLOP per example: nothing is timed for real."""
    sample = sample_batch(model, batch)
    monkeypatch.setattr(calibration, "_present_machine", lambda device, precision, clock: ("a test CPU", 2.0))
    monkeypatch.setattr(calibration, "compare", _timed_on_a_line(fixed, per_example, sample.size, planned))
    return calibration._measure(model, sample, 1e9 * sample.size, "adamw", "bf16-mixed", "cpu", None, 9)


@pytest.mark.parametrize("make", [_cnn_batch, _gpt_batch], ids=["cnn", "gpt"])
def test_plan_predicts_the_planned_batch_from_the_other_two(monkeypatch, make):
    model, batch = make()
    size = len(batch[1])
    line = 0.01 + size * 0.002  # seconds: 10 ms per step and 2 ms per example
    for planned in (0.5 * line, 3 * line):  # whatever the planned step took, the prediction is the line's
        mfu, source, check = _measure_on_a_test_cpu(monkeypatch, model, batch, 0.01, 0.002, planned)
        assert check["predicted ms"] == pytest.approx(line * 1e3)
        assert check["measured ms"] == pytest.approx(planned * 1e3)
        assert check["error"] == pytest.approx(line / planned - 1)
        assert check["fixed ms"] == pytest.approx(10) and check["ms per example"] == pytest.approx(2)
        # The MFU is the line's slope: the 1 GFLOP an example adds, in the 2 ms it adds, against 2 TFLOP/s.
        assert mfu == pytest.approx(1e9 / 0.002 / 2e12)
        assert "more per example" in source and check["clock"] == "thread CPU time"


def test_prediction_noise_is_the_spread_of_the_error_it_explains():
    """check["noise"] against the errors themselves: steps on a line with 10% Gaussian noise, timed 9 times at each
    batch, 400 times over: the spread of the prediction errors is what the noise reported on each run said."""
    generator = random.Random(0)
    small, large, size = 8, 48, 64

    def timed(batch: int) -> Timing:
        step = 0.01 + batch * 0.002
        return Timing([step * (1 + generator.gauss(0, 0.1)) for _ in range(9)])

    errors, noises = [], []
    for _ in range(400):
        timings = {b: timed(b) for b in (small, large, size)}
        a, b = (large - size) / (large - small), (size - small) / (large - small)
        predicted = a * timings[small].median + b * timings[large].median
        errors.append(predicted / timings[size].median - 1)
        noises.append(calibration._prediction_noise(timings, small, large, size))
    assert 0.7 < statistics.stdev(errors) / statistics.median(noises) < 1.4, (statistics.stdev(errors), noises[:5])
    quiet = {b: Timing([0.01 + b * 0.002] * 9) for b in (small, large, size)}
    assert calibration._prediction_noise(quiet, small, large, size) == 0


def test_plan_of_a_step_that_does_not_grow_with_the_batch(monkeypatch):
    """Launch-bound steps (a tiny model on a big GPU) take the same time at every batch: the line is flat and
    has no FLOP rate to read, so the MFU is that of whole steps at the larger timed batch, said in the source."""
    model, batch = _cnn_batch()
    _, large = calibration_sizes(len(batch[1]))
    mfu, source, check = _measure_on_a_test_cpu(monkeypatch, model, batch, 0.01, 0.0, 0.01)
    assert check["predicted ms"] == pytest.approx(10) and check["error"] == pytest.approx(0)
    assert mfu == pytest.approx(1e9 * large / 0.01 / 2e12) and "barely grows with the batch" in source


def _lesson_cnn():  # lesson 07's models at the tiny profile's sizes, where the ±25% below was measured
    torch.manual_seed(0)
    return gk.models.fast_cnn(8), (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))


def _lesson_gpt():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (16, 65))
    return gk.models.gpt(width=64, depth=2, heads=4, max_seq_len=64), (tokens[:, :-1], tokens[:, 1:])


@pytest.mark.slow
@pytest.mark.parametrize("make", [_lesson_cnn, _lesson_gpt], ids=["cnn", "gpt"])
def test_plan_predicts_a_real_step_on_a_cpu_within_a_quarter(make):
    """Real steps on one CPU thread, timed by its CPU time: the line through batches of an eighth and three
    quarters of the planned one predicts the planned step within ±25% (-16% to +8% seen on a busy 2-core machine)."""
    model, batch = make()
    plan = gk.hardware.plan(model, batch, gpus=["H100 SXM"], device="cpu")
    assert abs(plan.check["error"]) <= min(0.5, max(0.25, 3 * plan.check["noise"])), plan.check  # as lesson 07


# ---------------------------------------------------------------------------------------------
# The monitor, on a fake NVML


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, energy: bool = True, power_w: float = 100.0, reasons: int = 0x1 | 0x4) -> types.ModuleType:
    """A GPU drawing `power_w`, whose energy counter (mJ) advances with real time."""
    started = time.perf_counter()

    def not_supported(*args):
        raise FakeNVMLError("Not Supported")

    def energy_mj(handle):
        return int(5_000_000 + (time.perf_counter() - started) * power_w * 1000)

    fake = types.ModuleType("pynvml")
    fake.__dict__.update(
        NVMLError=FakeNVMLError,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=90, memory=30),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=2**30, total=16 * 2**30),
        nvmlDeviceGetPowerUsage=lambda handle: int(power_w * 1000),  # mW
        nvmlDeviceGetTemperature=lambda handle, sensor: 70,
        nvmlDeviceGetClockInfo=lambda handle, clock: {1: 1500, 2: 5000}[clock],
        nvmlDeviceGetCurrentClocksEventReasons=lambda handle: reasons,
        nvmlDeviceGetTotalEnergyConsumption=energy_mj if energy else not_supported,
    )
    return fake


@pytest.mark.parametrize("energy", [True, False], ids=["energy counter", "integrated power"])
def test_monitor_energy_means_and_reasons(monkeypatch, energy):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(energy=energy, power_w=100.0))
    with Monitor("cuda", interval=0.02) as monitor:
        assert monitor.source == ("energy counter" if energy else "integrated power")
        time.sleep(0.3)
        segment = monitor.lap()
    assert segment.energy_source == monitor.source and segment.samples >= 3
    # 100 W for the lap's duration, measured by a clock the monitor did not read.
    assert segment.energy_j == pytest.approx(100 * segment.seconds, rel=0.1)
    assert segment.mean_power_w == pytest.approx(100.0) and segment.mean_utilization == pytest.approx(90.0)
    assert segment.throttle_reasons == ["software power cap"]  # idle (0x1) is not a throttle
    row = monitor.samples[0]
    assert (row["sm_clock_mhz"], row["memory_clock_mhz"], row["temperature_c"]) == (1500, 5000, 70)
    assert row["reasons"] == ["idle", "software power cap"]
    assert segment.as_row()["throttle_reasons"] == "software power cap"
    assert monitor.co2_grams(3.6e6) == pytest.approx(monitor.grid_intensity)  # 1 kWh


@pytest.mark.parametrize("energy", [True, False], ids=["energy counter", "integrated power"])
def test_a_segment_shorter_than_the_interval_still_has_a_reading(monkeypatch, energy):
    """An epoch of 50 ms on an H100 is shorter than the 100 ms interval: the lap samples once itself."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(energy=energy, power_w=80.0))
    with Monitor("cuda", interval=10.0) as monitor:  # the thread's first sample, then none for 10 s
        time.sleep(0.05)
        monitor.lap()  # the first segment holds the thread's sample and this one
        segments = [monitor.lap() for _ in range(3)]  # each far shorter than the interval
    for segment in segments:
        assert segment.samples == 1 and segment.mean_power_w == pytest.approx(80.0), segment
        assert segment.as_row()["mean_power_w"] == pytest.approx(80.0)


def test_monitor_samples_at_its_interval(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    with Monitor("cuda", interval=0.05) as monitor:
        time.sleep(0.5)
    times = [row["t"] for row in monitor.samples]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert 0.045 <= gaps[len(gaps) // 2] < 0.2  # the median gap: the interval plus a little (2 loaded cores)


def test_monitor_without_nvml_says_so_and_measures_nothing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monitor = Monitor("cuda")
    assert not monitor.available and "nvidia-ml-py is not installed" in monitor.reason
    segment = monitor.start().lap()
    assert segment.as_row() == {} and segment.energy_j is None  # nothing, never zeros
    with pytest.raises(MonitorUnavailable, match="not installed"):
        Monitor("cuda", strict=True)
    cpu = Monitor("cpu", rapl_root=str(tmp_path / "powercap"))
    assert not cpu.available and "RAPL" in cpu.reason and "missing" in cpu.reason
    with pytest.raises(ValueError, match="interval must be a positive"):
        Monitor("cuda", interval=0)
    with pytest.raises(ValueError, match="grid_intensity"):
        Monitor("cuda", grid_intensity=-1)


def test_rapl_energy_with_wraparound(tmp_path):
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("1000000000\n")
    (zone / "energy_uj").write_text("999000000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-zone (cores): inside the package, not counted again
    monitor = Monitor("cpu", rapl_root=str(tmp_path)).start()
    assert monitor.available and monitor.source == "RAPL"
    (zone / "energy_uj").write_text("2000000\n")  # wrapped: 1,000 J to the top, then 2 J
    assert monitor.lap().energy_j == pytest.approx(3.0)


def test_co2_from_grid_intensity():
    assert joules_to_co2_grams(7.2e6, 100.0) == pytest.approx(200.0)  # 2 kWh at 100 g/kWh


# ---------------------------------------------------------------------------------------------
# fit(monitor=True)


def _tiny_data():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 8, 8, generator=generator)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (64,), generator=generator))


def test_fit_monitor_without_nvml_says_it_once_and_adds_nothing(monkeypatch, capsys, device):
    monkeypatch.setattr(gk.hardware.monitor, "RAPL_ROOT", "/nonexistent")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    model = gk.models.linear_classifier(image_shape=(3, 8, 8))
    history = gk.fit(model, _tiny_data(), epochs=2, batch_size=16, device=device, progress=False, monitor=True)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("monitor:")]
    assert len(said) == 1 and "not available" in said[0]
    assert not any("energy_j" in row or "mean_power_w" in row for row in history.epochs) and not history.monitor


def test_fit_monitor_adds_energy_per_epoch(monkeypatch, device):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(power_w=50.0))

    class Slow(torch.nn.Module):  # steps of 20 ms, so that every epoch holds several 10 ms samples
        def __init__(self):
            super().__init__()
            self.inner = gk.models.linear_classifier(image_shape=(3, 8, 8))

        def forward(self, images):
            time.sleep(0.02)
            return self.inner(images)

    model = Slow()
    watcher = Monitor("cuda", interval=0.01, grid_intensity=100.0)  # the fake GPU, while training on the CPU
    history = gk.fit(model, _tiny_data(), epochs=2, batch_size=16, device=device, progress=False, monitor=watcher)
    for row in history.epochs:
        assert row["energy_j"] == pytest.approx(50.0 * row["seconds"], rel=0.5, abs=0.5)
        assert row["joules_per_sample"] == pytest.approx(row["energy_j"] / 64)
        assert row["co2_grams"] == pytest.approx(row["energy_j"] / 3.6e6 * 100.0)
        assert row["mean_power_w"] == pytest.approx(50.0) and row["throttle_reasons"] == "software power cap"
    assert history.monitor and len(history.plot().axes) >= 3  # loss, accuracy, energy, the timeline


# ---------------------------------------------------------------------------------------------
# Contention (the measured demo runs in lesson 07: it starts two processes)


def test_contention_result_and_bad_input():
    result = ContentionResult(alone=[100.0, 90.0], shared=[50.0, 40.0], device="cpu", threads=2, rounds=3)
    assert result.alone_sum == 190.0 and result.shared_sum == 90.0
    assert result.slowdown == pytest.approx([0.5, 40 / 90])
    assert len(result.table()) == 3 and len(result.plot().axes[0].patches) == 6
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        gk.hardware.measure_contention(lambda: None, lambda: None, steps=0)


def test_segment_row_keeps_only_what_was_measured():
    assert Segment(seconds=1.0).as_row() == {}
    assert Segment(seconds=1.0, energy_j=5.0, samples=3).as_row() == {"energy_j": 5.0, "throttle_reasons": "none"}


def test_kernels_counted_grow_with_depth():
    from gpukit.hardware.planning import count_kernels

    batch = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    one = count_kernels(torch.nn.Sequential(torch.nn.Linear(8, 3)), batch)
    three = count_kernels(
        torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        ),
        batch,
    )
    assert 3 <= one < three  # at least a matmul forward, two backward; more layers, more kernels
