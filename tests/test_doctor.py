"""The environment report: facts collected here, and warning rules on fabricated reports."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit import checkup, env
from gpukit.checkup import GPUProcess, GPUStatus, Report, collect, warnings
from gpukit.hardware.clocks import clock_reasons

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def forbid_cuda(monkeypatch):
    """Fail on anything that would initialise CUDA (or the CUDA driver) in this process."""

    def fail(*args, **kwargs):
        raise AssertionError("the doctor touched the CUDA runtime in the calling process")

    for name in ("_lazy_init", "is_available", "device_count"):
        monkeypatch.setattr(torch.cuda, name, fail)


# ---------------------------------------------------------------------------------------------
# collect() on this machine


def test_collect_here_renders_as_text_and_html(forbid_cuda):
    report = collect()
    assert report.torch_version == torch.__version__
    assert report.python_version.count(".") == 2
    assert report.torch_threads == torch.get_num_threads()
    assert 1 <= report.usable_cpus <= report.cpu_count
    assert report.device in ("cuda", "mps", "cpu")
    text = str(report)
    assert torch.__version__ in text
    assert ("no problems found" in text) != ("Warnings:" in text)
    page = report._repr_html_()
    assert page.startswith("<div>") and "<table>" in page and torch.__version__ in page
    assert not torch.cuda.is_initialized()
    # Everything the lessons import was tried in a fresh Python; this suite's own environment runs them.
    assert report.import_check == "ok" and report.broken == [], report.imports
    assert set(report.imports) == set(checkup.IMPORT_CHECKS) and report.verdict.startswith("verdict: ready")


# ---------------------------------------------------------------------------------------------
# A torch/torchvision pair that does not belong together, faked: a torchvision package of our own, first on
# PYTHONPATH, with its own metadata (version), that fails as a mismatched build does


def fake_torchvision(folder, version: str, source: str):
    """A torchvision package in `folder` (to put first on PYTHONPATH) whose __init__ is `source`."""
    (folder / "torchvision").mkdir(parents=True)
    (folder / "torchvision" / "__init__.py").write_text(source)
    info = folder / f"torchvision-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchvision\nVersion: {version}\n")
    return folder


# What a CPU torch beside a CUDA torchvision raised on `import torchvision` (issue 44).
NO_NMS = 'raise RuntimeError("operator torchvision::nms does not exist")\n'
# torchvision imports, but its compiled operators cannot load: the first call fails.
NO_OPS = (
    "import types\n"
    "def nms(*args):\n"
    "    raise RuntimeError(\"Couldn't load custom C++ ops. This can happen if your PyTorch and torchvision "
    'versions are incompatible")\n'
    "ops = types.SimpleNamespace(nms=nms)\n"
)
CRASH = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"  # a compiled library of the wrong build


@pytest.fixture
def only_torch_and_torchvision(monkeypatch):
    """The import check reduced to torch and torchvision (seconds, not the lessons' whole list)."""
    checks = {label: checkup.IMPORT_CHECKS[label] for label in ("torch", "torchvision", "torchvision.ops.nms")}
    monkeypatch.setattr(checkup.imports, "IMPORT_CHECKS", checks)  # where import_check reads it


@pytest.mark.parametrize(
    "source, broken, said",
    [
        (NO_NMS, ["torchvision"], "RuntimeError: operator torchvision::nms does not exist"),
        (NO_OPS, ["torchvision.ops.nms"], "RuntimeError: Couldn't load custom C++ ops"),
        (CRASH, ["torchvision"], "crashed the Python process"),
    ],
    ids=["import fails", "operators fail", "import crashes"],
)
def test_a_torchvision_that_fails_is_broken_and_the_pair_to_install_is_named(
    tmp_path, monkeypatch, only_torch_and_torchvision, source, broken, said
):
    made_for_another_torch = "0.28.0+cu130"  # torch 2.13's, a CUDA build
    fake = fake_torchvision(tmp_path, made_for_another_torch, source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(sys, "path", [str(fake), *sys.path])  # this process's metadata reads the fake's version too
    report = collect(check_imports=True)
    assert report.torchvision_version == made_for_another_torch
    assert report.broken == broken and report.imports["torch"] == "ok", report.imports
    (pair,) = [warning for warning in warnings(report) if warning.startswith("torchvision")]
    assert said in pair and "it was made for torch 2.13" in pair, pair  # torch here is 2.14 (torchvision 0.29)
    wanted = checkup.torchvision_for(torch.__version__)
    assert f'"torchvision=={wanted}.*"' in pair and "--no-deps" in pair, pair
    assert report.verdict.startswith("verdict: BROKEN") and "BROKEN" in str(report)


def test_gpukit_doctor_fails_on_a_torchvision_that_does_not_import(tmp_path):
    """The command `make setup` ends with: exit code 1 and the pair to install, with the whole import check."""
    fake = fake_torchvision(tmp_path / "fake", "0.28.0+cu130", NO_NMS)
    paths = [str(fake), str(ROOT), os.environ.get("PYTHONPATH")]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "doctor"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=checkup.IMPORT_SECONDS + 120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "operator torchvision::nms does not exist" in done.stdout
    assert f"torchvision=={checkup.torchvision_for(torch.__version__)}.*" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("verdict: BROKEN: torchvision")


@pytest.mark.parametrize(
    "torch_version, torchvision, index",
    [
        ("2.14.1+cpu", "0.29", "https://download.pytorch.org/whl/cpu"),
        ("2.11.0+cu130", "0.26", "whl/cu130"),
        ("2.13.0", "0.28", None),
    ],
)
def test_the_torchvision_made_for_each_torch(torch_version, torchvision, index):
    assert checkup.torchvision_for(torch_version) == torchvision
    assert checkup.torch_for(f"{torchvision}.1") == torch_version[:4]
    command = checkup.torchvision_install_command(torch_version)
    assert f'"torchvision=={torchvision}.*"' in command
    assert (index in command) if index else "--index-url" not in command


def test_a_cpu_torch_beside_a_cuda_torchvision_of_the_same_release_is_named_before_it_fails():
    report = clean_report(torch_version="2.14.1+cpu", torchvision_version="0.29.1+cu130")
    report.imports = {"torch": "ok", "torchvision": "ok", "torchvision.ops.nms": "ok"}
    (pair,) = warnings(report)
    assert "is a cu130 build where torch is a cpu build" in pair and "whl/cpu" in pair, pair
    assert report.broken == [] and report.verdict == "verdict: ready, with 1 warning(s) above"


def test_a_missing_lessons_extra_is_said_but_not_broken():
    report = clean_report()
    report.imports = {
        "torch": "ok",
        "timm": "not installed (timm)",
        "numpy": "ModuleNotFoundError: No module named 'x'",
    }
    assert report.broken == ["numpy"]
    (row,) = [row for row in report.facts_table().rows if row["item"] == "what the lessons import"]
    assert row["value"] == "FAILS: numpy (see the warnings)"
    report.imports.pop("numpy")
    (row,) = [row for row in report.facts_table().rows if row["item"] == "what the lessons import"]
    assert "not installed: timm" in row["value"] and "gpukit[lessons]" in row["value"] and warnings(report) == []


def test_doctor_is_collect():
    assert isinstance(gpukit.doctor(check_imports=False), Report)


def test_bad_profile_becomes_a_warning(monkeypatch):
    monkeypatch.setenv("GPUKIT_PROFILE", "huge")
    report = collect(check_imports=False)
    assert report.profile is None
    assert any("GPUKIT_PROFILE" in warning for warning in warnings(report))


# ---------------------------------------------------------------------------------------------
# collect() with a fake NVML that reports one busy, hot GPU


class FakeNVMLError(Exception):
    pass


def _fake_pynvml() -> types.ModuleType:
    def not_supported(*args):
        raise FakeNVMLError("Not Supported")

    clocks = {1: 1410, 2: 1593}  # MHz, by NVML_CLOCK_SM / NVML_CLOCK_MEM
    fake = types.ModuleType("pynvml")
    fake.__dict__.update(
        NVMLError=FakeNVMLError,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "535.104.05",
        nvmlSystemGetCudaDriverVersion=lambda: 12020,  # CUDA 12.2
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: f"handle{index}",
        nvmlDeviceGetName=lambda handle: b"NVIDIA A100-SXM4-80GB",  # bytes, as older bindings return
        nvmlDeviceGetCudaComputeCapability=lambda handle: (8, 0),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(total=80 * GiB, used=10 * GiB, free=70 * GiB),
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetTemperature=lambda handle, sensor: 84,
        nvmlDeviceGetPowerUsage=not_supported,
        nvmlDeviceGetEnforcedPowerLimit=lambda handle: 400_000,  # mW
        nvmlDeviceGetClockInfo=lambda handle, clock: clocks[clock],
        # Only the older name: the doctor must fall back to it.
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: 0x4 | 0x20,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [types.SimpleNamespace(pid=4242, usedGpuMemory=8 * GiB)],
        nvmlSystemGetProcessName=lambda pid: "python",
    )
    return fake


def test_collect_reads_nvml_without_touching_cuda(monkeypatch, forbid_cuda):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(env.gpu_survey, "_surveys", {})  # make detect() ask the fake NVML
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    for name in ("GPUKIT_PROFILE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    report = collect(check_imports=False)

    assert report.device == "cuda" and report.profile == "gpu"
    assert report.nvml == "ok"
    assert (report.driver_version, report.driver_cuda_version) == ("535.104.05", "12.2")
    (gpu,) = report.gpus
    assert gpu.name == "NVIDIA A100-SXM4-80GB"
    assert (gpu.memory_total, gpu.memory_used) == (80 * GiB, 10 * GiB)
    assert (gpu.utilization, gpu.temperature, gpu.sm_clock, gpu.memory_clock) == (97, 84, 1410, 1593)
    assert gpu.power_draw is None and gpu.power_limit == 400.0  # W; unsupported queries become None
    assert gpu.clock_reasons == ["software power cap", "software thermal slowdown"]
    assert gpu.processes == [GPUProcess(4242, 8 * GiB, "python")]

    # The GPU's and the driver's; this machine's own CPU threads and load may add theirs.
    found = [warning for warning in warnings(report) if "CPU" not in warning]
    assert len(found) == 3, found
    assert any("12.2" in warning and "12.8" in warning for warning in found)
    assert any("software thermal slowdown" in warning for warning in found)
    assert any("4242" in warning for warning in found)
    text = str(report)
    assert "A100" in text and "4242" in text and "Warnings:" in text
    assert "4242" in report._repr_html_()
    assert not torch.cuda.is_initialized()


@pytest.fixture
def fake_nvml(monkeypatch, forbid_cuda):
    """The fake NVML's one A100 behind a driver for CUDA 12.2; detect() asks it afresh, no GPU variables set."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(env.gpu_survey, "_surveys", {})
    monkeypatch.setattr(env, "_explained", set())  # detect() prints each problem once per process
    monkeypatch.setattr(env, "_mps_available", lambda: False)
    for name in ("GPUKIT_PROFILE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)


def test_collect_explains_a_driver_too_old_for_torch(monkeypatch, fake_nvml, capsys):
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # needs a CUDA 13 driver; this one is for 12.2
    report = collect(check_imports=False)
    assert report.device == "cpu" and report.profile != "gpu"
    assert report.visible_gpus == ["NVIDIA A100-SXM4-80GB"]
    (warning,) = [warning for warning in warnings(report) if "fail to start" in warning]
    assert "uses the CPU" in warning and "535.104.05" in warning
    assert "CUDA 12.2" in warning and "whl/cu126" in warning and ">= 580" in warning
    assert warning in str(report)
    assert "whl/cu126" in capsys.readouterr().err  # detect()'s one line


def test_collect_explains_cuda_visible_devices_that_hide_every_gpu(monkeypatch, fake_nvml):
    monkeypatch.setattr(torch.version, "cuda", "12.2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    report = collect(check_imports=False)
    assert (report.device, report.cuda_visible_devices, report.visible_gpus) == ("cpu", "", [])
    (warning,) = [warning for warning in warnings(report) if warning.startswith("CUDA_VISIBLE_DEVICES")]
    assert "hides all 1 NVIDIA GPU" in warning and "nvidia-smi -L" in warning
    (row,) = [row for row in report.facts_table().rows if row["item"] == "CUDA_VISIBLE_DEVICES"]
    assert row["value"] == "''"


# ---------------------------------------------------------------------------------------------
# warnings() on fabricated reports


def clean_report(**changes) -> Report:
    """A healthy machine: a matching driver, an idle GPU holding only our own memory."""
    facts = dict(
        torch_version="2.11.0",
        cuda_runtime="12.8",
        driver_version="570.86.10",
        driver_cuda_version="12.8",
        cpu_count=16,
        usable_cpus=16,
        torch_threads=16,
        device="cuda",
        profile="gpu",
        nvml="ok",
        gpus=[
            GPUStatus(0, "NVIDIA H100 80GB HBM3", clock_reasons=["idle"], processes=[GPUProcess(os.getpid(), 2 * GiB)])
        ],
        nvidia_smi=True,
    )
    facts.update(changes)
    return Report(**facts)


def test_clean_report_has_no_warnings():
    report = clean_report()
    assert warnings(report) == []
    assert "no problems found" in str(report)
    assert "no problems found" in report._repr_html_()


def test_empty_cpu_machine_has_no_warnings():
    assert warnings(Report()) == []


@pytest.mark.parametrize("driver_cuda", ["12.2", "11.8"])
def test_old_driver(driver_cuda):
    (warning,) = warnings(clean_report(driver_cuda_version=driver_cuda))
    assert driver_cuda in warning and "12.8" in warning and "driver" in warning
    if driver_cuda.startswith("11"):
        assert "fail to start" in warning


def test_driver_of_an_older_cuda_major_says_gpukit_uses_the_cpu_and_what_to_install():
    report = clean_report(cuda_runtime="13.0", driver_cuda_version="12.4", device="cpu", profile="tiny")
    (warning,) = warnings(report)
    assert "fail to start" in warning and "uses the CPU" in warning and "570.86.10" in warning
    assert "whl/cu126" in warning and ">= 580" in warning


@pytest.mark.parametrize(
    "visible, shown, expected",
    [
        ("", [], "hides all 2 NVIDIA GPU(s)"),
        ("-1", [], "hides all 2 NVIDIA GPU(s)"),
        ("1,5", ["NVIDIA H100"], "lists 2 entries but CUDA shows only 1 GPU"),
        ("1", ["NVIDIA H100"], None),
        ("GPU-0c2f,GPU-9d1e", ["NVIDIA H100", "NVIDIA H100"], None),
    ],
)
def test_cuda_visible_devices_that_hide_gpus(visible, shown, expected):
    gpus = [GPUStatus(0, "NVIDIA H100"), GPUStatus(1, "NVIDIA H100")]
    device = "cuda" if shown else "cpu"
    report = clean_report(gpus=gpus, cuda_visible_devices=visible, visible_gpus=shown, device=device)
    found = warnings(report)
    if expected is None:
        assert found == []
    else:
        (warning,) = found
        assert expected in warning and f"CUDA_VISIBLE_DEVICES={visible!r}" in warning and "Unset it" in warning


def test_newer_driver_is_fine():
    assert warnings(clean_report(driver_cuda_version="13.0")) == []


@pytest.mark.parametrize(
    "reason", ["hardware thermal slowdown", "software power cap", "hardware slowdown", "software thermal slowdown"]
)
def test_throttling(reason):
    gpu = GPUStatus(1, "NVIDIA A100", clock_reasons=["idle", reason])
    (warning,) = warnings(clean_report(gpus=[gpu]))
    assert reason in warning and "GPU 1" in warning


def test_idle_and_application_clocks_are_not_throttling():
    gpu = GPUStatus(0, "NVIDIA A100", clock_reasons=["idle", "application clocks setting"])
    assert warnings(clean_report(gpus=[gpu])) == []


def test_foreign_process():
    gpu = GPUStatus(
        0, "NVIDIA A100", processes=[GPUProcess(os.getpid(), GiB), GPUProcess(os.getpid() + 1, 3 * GiB, "python")]
    )
    (warning,) = warnings(clean_report(gpus=[gpu]))
    assert f"PID {os.getpid() + 1}" in warning and f"PID {os.getpid()} " not in warning
    assert "3.0 GiB" in warning and "CUDA_VISIBLE_DEVICES" in warning


@pytest.mark.parametrize("seen_by", ["nvml", "nvidia-smi"])
def test_cpu_only_build_with_gpus(seen_by):
    gpus = clean_report().gpus if seen_by == "nvml" else []
    report = clean_report(cuda_runtime=None, gpus=gpus, nvml="ok" if gpus else "not installed", nvidia_smi=True)
    (warning,) = warnings(report)
    assert "CPU-only" in warning and "pytorch.org" in warning


def test_cpu_only_build_without_gpus_is_fine():
    assert warnings(clean_report(cuda_runtime=None, gpus=[], nvidia_smi=False, device="cpu")) == []


def test_too_many_threads():
    (warning,) = warnings(clean_report(torch_threads=32, usable_cpus=4))
    assert "32" in warning and "torch.set_num_threads(4)" in warning


def test_every_problem_at_once():
    gpu = GPUStatus(0, "NVIDIA A100", clock_reasons=["hardware slowdown"], processes=[GPUProcess(1, None)])
    report = clean_report(driver_cuda_version="12.0", gpus=[gpu], torch_threads=64, detect_error="bad profile")
    assert len(warnings(report)) == 5
    assert str(report).count("\n- ") == 5


def test_clock_reasons():
    assert clock_reasons(0) == []
    assert clock_reasons(0x1 | 0x40 | 0x1000) == ["idle", "hardware thermal slowdown", "unknown reason 0x1000"]


def test_collect_reports_power_limit_persistence_ecc_and_the_datasheet(monkeypatch, forbid_cuda):
    fake = _fake_pynvml()
    fake.__dict__.update(
        nvmlDeviceGetPowerManagementDefaultLimit=lambda handle: 500_000,  # mW: above the enforced 400 W
        nvmlDeviceGetPersistenceMode=lambda handle: 0,
        nvmlDeviceGetTotalEccErrors=lambda handle, error_type, counter: 2,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(env.gpu_survey, "_surveys", {})
    (gpu,) = collect(check_imports=False).gpus
    assert (gpu.power_limit, gpu.power_limit_default, gpu.persistence_mode, gpu.ecc_errors) == (400.0, 500.0, False, 2)
    report = Report(gpus=[gpu], pid=os.getpid())
    found = warnings(report)
    assert any("400 W, below its default 500 W" in warning for warning in found)
    assert any("2 uncorrected ECC" in warning for warning in found)
    (row,) = report.gpu_table().rows
    assert row["datasheet"].startswith("A100 80GB: cc 8.0, 312 bf16 TFLOP/s")
    healthy = GPUStatus(0, "NVIDIA L4", power_limit=72.0, power_limit_default=72.0, ecc_errors=0)
    assert not warnings(clean_report(gpus=[healthy]))


def test_threads_beyond_what_the_load_leaves_are_reported_with_the_fix():
    (warning,) = warnings(clean_report(torch_threads=16, usable_cpus=16, load=6.0))
    assert "torch uses 16 intra-op threads where 10 is safe" in warning and "torch.set_num_threads(10)" in warning


def test_an_oversubscribed_two_core_machine_is_reported():
    report = clean_report(torch_threads=2, usable_cpus=2, cpu_count=2, load=5.3)
    threads, load = warnings(report)
    assert "torch.set_num_threads(1)" in threads and "2 usable CPU(s)" in threads
    assert "oversubscribed: load 5.3 on 2 usable CPUs" in load
    (row,) = [row for row in report.facts_table().rows if row["item"] == "threads to time CPU work with"]
    assert row["value"].startswith("1 (")


def test_a_report_without_a_load_average_warns_of_no_load():
    assert warnings(clean_report(load=None)) == []


@pytest.mark.parametrize("present", ["/proc/driver/nvidia", "/dev/nvidiactl", "nvidia-smi", None])
def test_nvidia_ml_py_is_suggested_only_where_an_nvidia_gpu_could_be(monkeypatch, tmp_path, present):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: importing it fails
    signs = {"/proc/driver/nvidia": tmp_path / "proc_driver_nvidia", "/dev/nvidiactl": tmp_path / "dev_nvidiactl"}
    monkeypatch.setattr(checkup.nvml, "NVIDIA_DRIVER_PATHS", tuple(map(str, signs.values())))
    bin_folder = tmp_path / "bin"  # PATH holds only this folder: nvidia-smi is found only if put there
    bin_folder.mkdir()
    monkeypatch.setenv("PATH", str(bin_folder))
    if present == "nvidia-smi":
        (bin_folder / "nvidia-smi").write_text("#!/bin/sh\n")
        (bin_folder / "nvidia-smi").chmod(0o755)
    elif present is not None:
        signs[present].mkdir()
    nvml = checkup.nvml._nvml_facts()["nvml"]
    if present is None:  # a laptop, a Mac, a CPU server: nothing to install
        assert "not installed" in nvml and "nvidia-ml-py" not in nvml and "no NVIDIA" in nvml, nvml
    else:
        assert "pip install nvidia-ml-py" in nvml, nvml
