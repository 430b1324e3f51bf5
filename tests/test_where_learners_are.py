"""The machines learners have: a T4 (no bf16, 16 GB; Kaggle gives two), Apple silicon, a laptop's CPU.

The GPUs are the fake ones of tests/fake_cuda.py (calls and argument handling, not numbers); MPS is faked by making
torch report it available, with every CUDA entry point made to fail, so that reaching one fails the test. Lessons'
own cells are run here where they decide (backend, precision, sizes); the rest of each lesson is checked statically
for CUDA uses a Mac would reach (tests/cuda_guards.py). Neither real NCCL nor MPS kernels can run on this machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import gpukit as gk
from gpukit.data.images import SHAPE_CLASSES, ImageDataset
from gpukit.precision import get_precision
from tests import cuda_guards
from tests.fake_cuda import T4, GiB
from tests.helpers import lesson_cells, run_lesson_cells

LESSONS = {path.name[:2]: path for path in sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))}

two_t4 = pytest.mark.parametrize("fake_cuda", [[T4, T4]], indirect=True, ids=["2xT4"])


@pytest.fixture
def automatic_profile(monkeypatch):
    for variable in ("GPUKIT_PROFILE", "CI"):
        monkeypatch.delenv(variable, raising=False)


@two_t4
def test_kaggles_two_t4s_train_in_fp16_with_loss_scaling(fake_cuda, automatic_profile):
    env = gk.detect()
    assert (env.device, env.gpu_count, env.profile.name) == ("cuda", 2, "gpu")
    assert not env.bf16 and not env.tf32  # compute capability 7.5
    assert env.fast_precision == "fp16-mixed"
    precision = get_precision(env.fast_precision, "cuda")
    assert precision.scaler.is_enabled()  # fp16 without loss scaling loses small gradients (lesson 01)
    with pytest.raises(ValueError, match="fp16-mixed"):  # bf16 refused, naming what to use instead
        get_precision("bf16-mixed", "cuda")
    # What lessons 00, 01, 06, 07 and 09 build on the GPU path from env.fast_precision: a training step with a scaler
    model = gk.models.fast_cnn(8).to("cuda")
    step = gk.step.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), env.fast_precision, device="cuda")
    assert step.precision.name == "fp16-mixed" and step.precision.scaler.is_enabled()
    with pytest.raises(ValueError, match="fp16-mixed"):
        gk.step.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), "bf16-mixed", device="cuda")


def test_an_h100_trains_in_bf16(fake_cuda, automatic_profile):  # the fixture's default GPU
    env = gk.detect()
    assert env.bf16 and env.fast_precision == "bf16-mixed"


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp32"])
def test_the_gpu_profiles_largest_runs_fit_a_t4(precision):
    """The lessons' largest models at the gpu profile's largest batches, predicted in fp16 (the T4's fast precision)
    and in fp32 (lesson 01's batch-size sweep, lessons 06 and 10's GPT), with room to spare in a T4's 16 GB (for
    cuDNN's workspaces and the CUDA context): the CNN at the largest batch of the batch-size sweep, the GPT of
    lessons 06 and 10 with AdamW."""
    profile = gk.PROFILES["gpu"]
    batch = max(profile.batch_sizes)
    cnn = gk.memory.estimate(
        gk.models.fast_cnn(profile.width),
        torch.zeros(batch, 3, 32, 32),
        torch.zeros(batch, dtype=torch.long),
        precision=precision,
        device="cpu",
    )
    model = gk.models.gpt(
        max_seq_len=profile.seq_len, width=profile.gpt_width, depth=profile.gpt_depth, heads=profile.gpt_heads
    )
    tokens = torch.zeros(64, profile.seq_len, dtype=torch.long)  # lesson 06's GPT_BATCH in the gpu profile
    gpt = gk.memory.estimate(model, (tokens, tokens), optimizer="adamw", precision=precision, device="cpu")
    share = {"fp16-mixed": 1 / 4, "fp32": 1 / 2}[precision]  # the CNN at batch 1024 takes 4.5 GiB in fp32
    for name, prediction in {"CNN": cnn, "GPT": gpt}.items():
        assert prediction.total < share * T4.total_memory, (name, gk.format_bytes(prediction.total))
    assert T4.total_memory == 16 * GiB


def test_apple_silicon_gets_mps_laptop_sizes_and_fp32(apple_silicon):
    env = gk.detect()
    assert env.device == "mps" and env.gpu_count == 0
    assert env.profile.name == ("tiny" if env.cpu_count <= 2 else "cpu")  # laptop sizes, never the gpu profile
    assert env.fast_precision == "fp32"
    assert gk.resolve_device(None) == torch.device("mps")


@pytest.fixture
def shapes_asked(monkeypatch) -> list[int]:
    """gk.data.shapes gives blank datasets of the sizes asked, and lists the training sizes: a lesson's setup cell
    draws up to 60,000 shapes (5-25 s here), and its sizes, not its images, are what these tests check."""
    asked = []

    def blank(size: int) -> ImageDataset:
        images, labels = torch.zeros(size, 3, 32, 32, dtype=torch.uint8), torch.zeros(size, dtype=torch.long)
        return ImageDataset(images, labels, SHAPE_CLASSES, torch.zeros(3), torch.ones(3), boxes=torch.zeros(size, 4))

    def blank_shapes(train_size: int, test_size: int, seed: int = 0) -> tuple[ImageDataset, ImageDataset]:
        asked.append(train_size)
        return blank(train_size), blank(test_size)

    monkeypatch.setattr(gk.data, "shapes", blank_shapes)
    return asked


@pytest.mark.parametrize(
    "fake_cuda", [[T4, T4], [T4]], indirect=True, ids=["2xT4 (Kaggle): NCCL", "1xT4 (Colab): gloo on the CPU"]
)
def test_lesson_04_picks_nccl_and_no_bf16_for_kaggles_two_t4s(fake_cuda, automatic_profile, shapes_asked):
    """Lesson 04's own setup and variant cells, run here on fake T4s: two get one NCCL process per GPU at gpu sizes,
    with gradient compression in fp16 only; one T4 leaves data parallelism to 2 CPU processes over gloo (bf16 on
    their CPUs stays). Real NCCL needs the GPUs: the launch itself is not run."""
    two = len(fake_cuda.gpus) == 2
    lesson = run_lesson_cells(LESSONS["04"], ["301b3795", "a8f4c2d6"])
    choice = {name: lesson[name] for name in ("BACKEND", "WORKERS", "DEVICE", "MULTI_GPU")}
    expected = ("nccl", 2, "cuda", True) if two else ("gloo", 2, "cpu", False)
    assert tuple(choice.values()) == expected, choice
    assert lesson["profile"].name == ("gpu" if two else gk.env.profile_for("cpu").name)
    assert shapes_asked == [lesson["profile"].train_size // 4]
    assert ("bf16 compression" in lesson["VARIANTS"]) is not two and "fp16 compression" in lesson["VARIANTS"]
    # gk.distributed.launch accepts the lesson's choice; with two GPUs its own default is the same
    check = gk.distributed.launcher._check_backend_and_nprocs
    assert check(lesson["BACKEND"], lesson["WORKERS"]) == expected[:2]
    assert check(None, None) == ("nccl", len(fake_cuda.gpus))  # one process per GPU, also for a single one
    # On each GPU: the largest all-reduce message (1 GiB at gpu sizes), timed by the benchmark and again by the lesson,
    # and a CNN step at BATCH, within the batches test_the_gpu_profiles_largest_runs_fit_a_t4 predicts to fit a T4.
    assert 2 * lesson["MESSAGE_SIZES"][-1] <= T4.total_memory / 4
    assert lesson["BATCH"] <= max(gk.PROFILES["gpu"].batch_sizes)


class _MpsOnTheCpu(TorchFunctionMode):
    """Tensors asked for on "mps" are made on the CPU: this machine's torch has no MPS backend. Code that only places
    tensors on the lesson's device runs; it proves nothing about MPS's kernels."""

    @staticmethod
    def _moved(value):
        if isinstance(value, str) and value.split(":")[0] == "mps":
            return "cpu"
        return torch.device("cpu") if isinstance(value, torch.device) and value.type == "mps" else value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.device:  # naming the device is not placing a tensor on it
            return func(*args, **(kwargs or {}))
        args = tuple(self._moved(value) for value in args)
        kwargs = {name: self._moved(value) for name, value in (kwargs or {}).items()}
        return func(*args, **kwargs)


@pytest.fixture
def apple_silicon(monkeypatch, automatic_profile):
    """torch as on a Mac with Apple silicon and 8 CPU cores: MPS available; CUDA absent as in torch built without it
    (is_available() and is_initialized() False, device_count() 0), and any other CUDA call, a tensor made on "cuda"
    included (it starts CUDA through torch.cuda._lazy_init), raises and is listed in the list this returns."""
    reached: list[str] = []

    def refused(name: str):
        def call(*args, **kwargs):
            reached.append(name)
            raise AssertionError(f"torch.cuda.{name} was reached on an MPS machine")

        return call

    answers = {"is_available": lambda: False, "is_initialized": lambda: False, "device_count": lambda: 0}
    replacements = {id(getattr(torch.cuda, name)): answer for name, answer in answers.items()}
    replacements[id(torch.cuda._lazy_init)] = refused("_lazy_init")
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] in ("torch", "gpukit"):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if id(value) in replacements:
                    monkeypatch.setattr(module, name, replacements[id(value)])
    # torch.manual_seed calls these on every machine: they queue the seeding until CUDA starts, which a Mac never does
    queued = {"manual_seed", "manual_seed_all", "seed", "seed_all"}
    for name, value in list(vars(torch.cuda).items()):
        defined_there = getattr(value, "__module__", "").startswith("torch.cuda")  # not typing's, functools', …
        if callable(value) and defined_there and not name.startswith("_") and name not in answers.keys() | queued:
            monkeypatch.setattr(torch.cuda, name, refused(name))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # an M1, M2 or M3: 8 cores
    monkeypatch.setattr(gk.env, "_cuda_survey", lambda: gk.env.gpu_survey._Survey([], ""))  # no NVIDIA GPU either
    with _MpsOnTheCpu():
        yield reached


def test_the_apple_silicon_fake_answers_as_a_mac_and_refuses_cuda(apple_silicon):
    """The fake the lessons' setups run under: CUDA queries answered as a Mac's torch does, any CUDA call refused."""
    assert (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.is_initialized()) == (False, 0, False)
    torch.manual_seed(0)  # seeds CUDA lazily, on a Mac too
    for reach in (torch.cuda.synchronize, torch.cuda.get_device_capability, lambda: torch.zeros(1, device="cuda")):
        with pytest.raises(AssertionError, match="reached on an MPS machine"):
            reach()
    assert apple_silicon == ["synchronize", "get_device_capability", "_lazy_init"]
    assert torch.zeros(2, device="mps").device.type == "cpu"  # no MPS backend here: placed on the CPU instead
    assert gk.resolve_device(None) == torch.device("mps")


@pytest.mark.parametrize("lesson", sorted(LESSONS))
def test_each_lessons_setup_on_apple_silicon_picks_mps_laptop_sizes_and_reaches_no_cuda(
    lesson, apple_silicon, shapes_asked
):
    """Each lesson's setup cell (imports, gk.detect(), the profile and its sizes, the device) run here with MPS
    faked: device "mps", the laptop profile, fp32 as the fast precision, and no CUDA call. What the later cells do
    on MPS is checked statically (test_every_lessons_cuda_use_is_guarded); MPS kernels cannot run here."""
    setup = list(lesson_cells(LESSONS[lesson]))[1]  # the first cell installs gpukit where it is missing
    namespace = run_lesson_cells(LESSONS[lesson], [setup])
    env = namespace["env"]
    assert (env.device, env.gpu_count, env.profile.name, env.fast_precision) == ("mps", 0, "cpu", "fp32"), env
    assert all(size <= gk.PROFILES["cpu"].train_size for size in shapes_asked), shapes_asked  # never gpu sizes
    if "device" in namespace:
        assert torch.device(namespace["device"]).type == "mps", namespace["device"]
    if lesson == "04":  # data parallelism needs two devices: 2 CPU processes over gloo, at laptop sizes
        assert (namespace["BACKEND"], namespace["DEVICE"], namespace["profile"].name) == ("gloo", "cpu", "cpu")
    assert apple_silicon == [], apple_silicon


def test_every_lessons_cuda_use_is_guarded():
    """Every CUDA-only use in every lesson's code cells (torch.cuda calls, .cuda(), "cuda" and "nccl" as values)
    sits under a CUDA test (tests/cuda_guards.py): a Mac's torch, built without CUDA, never reaches one."""
    found = {}
    for number, path in LESSONS.items():
        cells = lesson_cells(path)
        names = cuda_guards.cuda_names(list(cells.values()))
        for cell_id, source in cells.items():
            for line, text in cuda_guards.unguarded_cuda_uses(source, names):
                found[f"{number}[{cell_id}]:{line}"] = text
    assert found == {}, found
    assert "MULTI_GPU" in cuda_guards.cuda_names(
        [source for path in LESSONS.values() for source in lesson_cells(path).values()]
    )  # lesson 04 guards with a name: the check reads it as a CUDA test


# gpukit's CUDA-only uses that no CUDA test guards where they stand, and why no Mac reaches CUDA through them.
CUDA_BY_CONTRACT = {
    "checkup._nccl_version": "asks the NCCL library its version (no GPU); a torch without NCCL raises, caught",
    "data.decoding.decode_table": "its CUDA rows run only where torch.cuda.is_available() (gpu=True checks it)",
    "data.prefetching._copy": "CUDAPrefetcher refuses a device that is not CUDA when it is made",
    "data.prefetching.__iter__": "CUDAPrefetcher refuses a device that is not CUDA when it is made",
    "distributed.launcher.<module>": "BACKENDS: the names launch accepts",
    "distributed.process_group.setup": "NCCL is the default only where gk.detect() (in a worker, torch) finds CUDA",
    "distributed.scaling.benchmark_backend": "the backend of each device name",
    "env.detect": "'cuda' only where the survey found CUDA GPUs this torch can use",
    "env.cuda_index": "refuses a device that is not CUDA",
    "fp8.speed.compare_speed": "a default argument; training_config refuses before any work where no CUDA GPU is seen",
    "fp8.training.supported": "asks CUDA only once _hardware_reason found a CUDA device that torch sees, with FP8 tensor cores",
    "commands.gpucheck.benchmark_command": "the GPU check runs on CUDA machines only (test_gpucheck: nothing starts without)",
    "hardware.monitor.__init__": "a default argument; for a CUDA device a Monitor asks NVML, never CUDA",
    "hardware.planning.plan": "plans for CUDA GPUs with fake tensors, as gk.memory.estimate(device='cuda')",
    "hardware.calibration._measure_here": "the name of CUDA's clock in a table",
    "memory.allocator._cuda_device": "the check that refuses a device that is not CUDA",
    "memory.allocator.limit_gpu_memory": "calls _cuda_device first",
    "memory.allocator.expandable_segments": "calls _cuda_device first",
    "memory.allocator.record_snapshot": "calls _cuda_device first",
    "memory.measuring.cublas_workspace_bytes": "the current CUDA GPU's workspace: breakdown and lesson 03 ask on CUDA only",
    "memory.plan._free_for_training": "called only where the target is CUDA and torch.cuda.is_available()",
    "memory.workspaces.__torch_dispatch__": "the mode of layer_workspaces, which refuses a device that is not CUDA",
    "memory.workspaces.layer_workspaces": "a default argument; refuses a device that is not CUDA",
    "practice.lesson00._measure_gpu_over_cpu": "an exercise's measure; Exercise.check skips it (no call) where torch sees no CUDA GPU",
    "runfile.run_environment": "a key: the CUDA version torch was built for (None on a Mac)",
}


def test_gpukit_reaches_cuda_only_behind_a_cuda_test_or_by_contract():
    """gpukit's CUDA-only uses sit under a CUDA test, or in the functions CUDA_BY_CONTRACT lists with the reason no
    Mac reaches CUDA through them; a new unguarded use (or a stale entry) fails until it is guarded or listed."""
    package = Path(gk.__file__).parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)  # a package's own code: its name
        for name, uses in cuda_guards.unguarded_in_functions(path.read_text()).items():
            found[f"{module}.{name}"] = uses
    assert found.keys() == CUDA_BY_CONTRACT.keys(), {
        "unguarded, not listed": {name: found[name] for name in found.keys() - CUDA_BY_CONTRACT.keys()},
        "listed, no longer found": sorted(CUDA_BY_CONTRACT.keys() - found.keys()),
    }


def test_the_guard_check_finds_what_a_mac_would_reach():
    """The static check flags each unguarded form of CUDA use, and none that a CUDA test guards."""
    unguarded = [
        "torch.cuda.synchronize()",
        "model.cuda()",
        'x = torch.zeros(1, device="cuda")',
        'gk.distributed.launch(work, 2, backend="nccl")',
        'gk.fit(model, data, device="cuda:1")',
        "stream = torch.cuda.Stream",
        'ok = device == "cuda" or torch.cuda.get_device_capability() >= (8, 0)',
        "if device.type != 'cuda':\n    torch.cuda.synchronize()",
        "def f(device):\n    if device.is_cuda:\n        pass\n    torch.cuda.synchronize(device)",
        'if name.startswith("cpu"):\n    torch.cuda.synchronize()',
    ]
    guarded = [
        "ok = torch.cuda.is_available() and torch.cuda.device_count() > 0 or torch.cuda.is_initialized()",
        'if device == "cuda":\n    torch.cuda.synchronize()',
        'if device.type != "cuda":\n    pass\nelif True:\n    torch.cuda.synchronize()',
        'used = torch.cuda.memory_allocated() if device.type == "cuda" else 0',
        'bf16 = device.type != "cuda" or torch.cuda.get_device_capability() >= (8, 0)',
        'fp8 = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)',
        'BACKEND = "nccl" if env.gpu_count >= 2 else "gloo"\nDEVICE = "cuda" if BACKEND == "nccl" else "cpu"',
        'MULTI = BACKEND == "nccl"\nif MULTI:\n    torch.cuda.synchronize()',
        'plan = gk.memory.estimate(model, images, device="cuda")  # a prediction, made on the CPU',
        'def f(device):\n    if device.type != "cuda":\n        return\n    torch.cuda.synchronize(device)',
        'rates = [torch.cuda.synchronize() for row in rows if row["device"] == "cuda"]',
        'if name.startswith("cuda"):\n    torch.cuda.synchronize()',
    ]
    for source in unguarded:
        assert len(cuda_guards.unguarded_cuda_uses(source, cuda_guards.cuda_names([source]))) == 1, source
    for source in guarded:
        assert cuda_guards.unguarded_cuda_uses(source, cuda_guards.cuda_names([source])) == [], source
