import pytest
import torch

import gpukit as gk
from gpukit.precision import Precision, get_precision


def test_strings_become_objects_once():
    cpu = torch.device("cpu")
    for name in gk.PRECISIONS:
        if name == "tf32":
            continue
        precision = get_precision(name, cpu)
        assert precision.name == name and get_precision(precision, cpu) is precision
    assert get_precision("fp16-mixed", cpu).scaler.is_enabled()
    assert not get_precision("bf16-mixed", cpu).scaler.is_enabled()  # bf16 needs no loss scaling


def test_autocast_dtypes_on_cpu():
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    for name, dtype in (("fp32", torch.float32), ("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)):
        with get_precision(name, "cpu").autocast():
            assert layer(x).dtype == dtype


def test_unknown_and_unsupported_precisions():
    with pytest.raises(ValueError, match="precision='fp8' is unknown; use one of 'fp32'"):
        get_precision("fp8", "cpu")
    with pytest.raises(ValueError, match="tf32.*use 'fp32'"):
        get_precision("tf32", "cpu")


def test_pre_ampere_gpu_refuses_bf16_and_tf32(monkeypatch):
    """On a V100 (compute capability 7.0) bf16 and tf32 are unsupported: the error names what to use."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    with pytest.raises(ValueError, match="V100.*7.0. Use 'fp16-mixed'"):
        get_precision("bf16-mixed", "cuda")
    with pytest.raises(ValueError, match="Use 'fp32' or 'fp16-mixed'"):
        get_precision("tf32", "cuda")


def test_fp16_overflow_skips_the_step_and_is_counted():
    precision = get_precision("fp16-mixed", "cpu")
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    precision.backward((weight * torch.tensor([1.0, float("inf"), 1.0])).sum())
    precision.step(optimizer, [weight])
    assert precision.skipped_steps == 1 and torch.equal(weight.detach(), torch.ones(3))  # step skipped
    optimizer.zero_grad()
    precision.backward(weight.sum())
    precision.step(optimizer, [weight])
    assert precision.skipped_steps == 1 and not torch.equal(weight.detach(), torch.ones(3))


def test_clipping_bounds_the_unscaled_gradient():
    precision = get_precision("fp16-mixed", "cpu")
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    precision.backward((weight * 100).sum())  # true gradient norm 200, scaled by 65536
    precision.step(optimizer, [weight], clip=1.0)
    assert weight.detach().norm().item() == pytest.approx(1.0, rel=1e-3)  # clipped to the true-norm bound


def test_scaler_state_round_trips_and_checks_the_name():
    precision = get_precision("fp16-mixed", "cpu")
    precision.skipped_steps = 3
    state = precision.state_dict()
    again = get_precision("fp16-mixed", "cpu")
    again.load_state_dict(state)
    assert again.skipped_steps == 3 and again.scaler.get_scale() == precision.scaler.get_scale()
    with pytest.raises(ValueError, match="pass precision='fp16-mixed'"):
        get_precision("bf16-mixed", "cpu").load_state_dict(state)


def test_tf32_flags_are_restored():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with Precision("tf32", torch.device("cpu")).flags():
        assert torch.get_float32_matmul_precision() == "high"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_fast_kernels_on_cuda_come_from_the_hardware():
    from gpukit.precision import has_fast_kernels

    assert has_fast_kernels("fp32", "cpu")[0]
    for name in ("bf16-mixed", "fp16-mixed"):
        fast, reason = has_fast_kernels(name, "cpu")
        assert not fast and "cpu" in reason
    assert has_fast_kernels("fp16-mixed", "cuda", (7, 0))[0]
    assert not has_fast_kernels("bf16-mixed", "cuda", (7, 5))[0]
    assert has_fast_kernels("bf16-mixed", "cuda", (9, 0))[0]
    assert "6.1" in has_fast_kernels("fp16-mixed", "cuda", (6, 1))[1]
    with pytest.raises(ValueError, match="unknown"):
        has_fast_kernels("fp8", "cpu")


def _interleaved_speedups(step_seconds: dict[str, float]) -> dict[str, float]:
    """fp32's step time over each precision's, timed by gk.bench.compare as lesson 01 times them, on a made-up
    clock that each step advances by its `step_seconds`: the measurement a CPU with such kernels would make."""
    now = [0.0]

    def step_of(seconds):
        return lambda: now.__setitem__(0, now[0] + seconds)

    steps = {name: step_of(seconds) for name, seconds in step_seconds.items()}
    timings = gk.bench.compare(steps, device="cpu", warmup=1, repeats=5, clock=lambda: now[0])
    return {name: timings["fp32"].median / timing.median for name, timing in timings.items()}


@pytest.mark.parametrize(
    "cpu, step_seconds, trains_fully",
    [  # seconds per step of lesson 01's tiny CNN (batch 64) as measured on the two kinds of host the lessons met
        ("Intel Xeon with AMX-BF16", {"fp32": 0.0141, "bf16-mixed": 0.0100, "fp16-mixed": 0.0400}, {"bf16-mixed"}),
        ("AMD EPYC without bf16 units", {"fp32": 0.0141, "bf16-mixed": 0.2800, "fp16-mixed": 0.0400}, set()),
    ],
)
def test_a_cpu_decides_16_bit_training_from_its_interleaved_timing(cpu, step_seconds, trains_fully):
    # Lesson 01 starts a full 16-bit run where the step measured at least as fast as fp32's; before, every CPU
    # answered "no fast kernels", so an AMX host that measured bf16 1.41x fp32 never checked bf16's accuracy.
    from gpukit.precision import has_fast_kernels

    speedups = _interleaved_speedups(step_seconds)
    decisions = {name: has_fast_kernels(name, "cpu", measured_speedup=speedups[name]) for name in speedups}
    assert {name for name, (fast, _) in decisions.items() if fast and name != "fp32"} == trains_fully, (cpu, decisions)
    for name in ("bf16-mixed", "fp16-mixed"):
        assert f"{speedups[name]:.2f}x fp32's speed" in decisions[name][1]  # the reason says what was measured
    # On CUDA the hardware decides: a launch-bound tiny step that times bf16 slower does not cancel tensor cores.
    assert has_fast_kernels("bf16-mixed", "cuda", (9, 0), measured_speedup=0.9)[0]
    with pytest.raises(ValueError, match="measured_speedup=0.0 is not a positive number"):
        has_fast_kernels("bf16-mixed", "cpu", measured_speedup=0.0)


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_train_step_takes_a_precision_name(kind):
    """TrainStep("bf16-mixed") equals TrainStep(get_precision("bf16-mixed", device)) for the model's device."""
    if kind == "cnn":
        make, batch = (lambda: gk.models.fast_cnn(8)), (torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    else:
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
        make, batch = (
            (lambda: gk.models.gpt(max_seq_len=16, width=32, depth=1, heads=2)),
            (tokens[:, :-1], tokens[:, 1:]),
        )
    losses = []
    for precision in ("bf16-mixed", gk.get_precision("bf16-mixed", "cpu")):
        torch.manual_seed(0)
        model = make()
        step = gk.step.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), precision)
        assert step.precision.name == "bf16-mixed" and step.precision.device.type == "cpu"
        losses.append([step(batch).item() for _ in range(2)])
    assert losses[0] == losses[1]
    with pytest.raises(ValueError, match="bf17"):
        gk.step.TrainStep(make(), None, "bf17")
