"""Watch a GPU while it trains: a background sampler of NVML (the driver's management library).

About 10 times a second it reads utilisation, memory used, power, temperature, SM and memory
clocks and the clock-event ("throttle") reasons. `lap()` closes a segment (an epoch) and returns
its energy: from the GPU's total-energy counter where it has one (Volta and later), else the
sampled power integrated over time; the segment says which. On a CPU, energy comes from RAPL
(`/sys/class/powercap`) when it is readable. Where neither exists, the monitor is not available
and says why in one line; it never makes up zeros.

Why not the `zeus` package? Its ZeusMonitor reads the same NVML energy counter (and RAPL) and
does it well, but it installs pandas, scipy and scikit-learn and measures energy only, not the
clocks and throttle reasons a lesson needs to explain a slow epoch; nvidia-ml-py (gpukit's "gpu"
extra) is all this needs. Lesson 07 compares the two.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..env import cuda_index
from ..plots import plot_monitor
from ..validation import check_number
from .clocks import BENIGN_CLOCK_REASONS, clock_reasons

# Grams of CO₂ per kWh of electricity: the world average for 2023 (Ember, Global Electricity
# Review 2024: about 480 g/kWh). Your grid differs (e.g. ~30 in Sweden, ~700 in India): set yours.
DEFAULT_GRID_INTENSITY = 480.0

RAPL_ROOT = "/sys/class/powercap"


class MonitorUnavailable(RuntimeError):
    """Energy or GPU telemetry was asked for where there is none (no NVML GPU, no readable RAPL)."""


def joules_to_co2_grams(joules: float, grid_intensity: float = DEFAULT_GRID_INTENSITY) -> float:
    """Grams of CO₂ for `joules` of electricity at `grid_intensity` g/kWh (1 kWh = 3.6 MJ)."""
    return joules / 3.6e6 * grid_intensity


@dataclass
class Segment:
    """What one lap (an epoch) drew. Fields the source cannot measure are None, never 0."""

    seconds: float
    energy_j: float | None = None
    energy_source: str | None = None  # "energy counter", "integrated power" or "RAPL"
    mean_power_w: float | None = None
    mean_utilization: float | None = None  # % of time a kernel ran
    throttle_reasons: list[str] = field(default_factory=list)  # reasons seen under load (not idle)
    samples: int = 0

    def as_row(self) -> dict:
        """The History epoch columns: only what was measured."""
        row = {"energy_j": self.energy_j, "mean_power_w": self.mean_power_w, "mean_utilization": self.mean_utilization}
        row = {key: value for key, value in row.items() if value is not None}
        if self.samples:  # GPU samples: the reasons are a measurement even when there are none
            row["throttle_reasons"] = ", ".join(self.throttle_reasons) or "none"
        return row


def _nvml_index(cuda_index: int) -> int:
    """CUDA device index → NVML index: NVML ignores CUDA_VISIBLE_DEVICES, so map through it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if visible and visible[0] and all(entry.strip().isdigit() for entry in visible) and cuda_index < len(visible):
        return int(visible[cuda_index])
    return cuda_index


class _Rapl:
    """CPU package energy from Linux RAPL counters (µJ, wrapping at max_energy_range_uj)."""

    def __init__(self, root: str):
        self.zones = [Path(path) for path in sorted(glob.glob(os.path.join(root, "intel-rapl:[0-9]*")))]
        self.zones = [zone for zone in self.zones if ":" not in zone.name.split("intel-rapl:")[1]]  # packages only
        if not self.zones:
            raise MonitorUnavailable(f"no RAPL energy counters: {root} is missing or lists no package")
        try:
            self.ranges = [int((zone / "max_energy_range_uj").read_text()) for zone in self.zones]
            self.read()
        except (OSError, ValueError) as error:
            raise MonitorUnavailable(f"RAPL energy counters in {root} are not readable ({error})") from error

    def read(self) -> list[int]:
        return [int((zone / "energy_uj").read_text()) for zone in self.zones]

    def joules(self, before: list[int], after: list[int]) -> float:
        return sum((b - a) % span for a, b, span in zip(before, after, self.ranges)) / 1e6


class Monitor:
    """A background sampler of one GPU (NVML), or of the CPU's energy (RAPL).

    with gk.hardware.Monitor(device="cuda") as monitor:
        train()
        segment = monitor.lap()        # energy, mean power and utilisation, throttle reasons
    monitor.samples                    # the timeline: one dict per sample (t in s from start)

    interval: seconds between samples (default 0.1: about 10 Hz). strict: raise MonitorUnavailable
    where nothing can be measured; otherwise `available` is False and `reason` says why, once.
    """

    def __init__(
        self,
        device="cuda",
        *,
        interval: float = 0.1,
        grid_intensity: float = DEFAULT_GRID_INTENSITY,
        strict: bool = False,
        rapl_root: str | None = None,
    ):
        check_number("interval", interval, note="of seconds (0.1 samples at 10 Hz)")
        check_number("grid_intensity", grid_intensity, positive=False, note="(grams of CO₂ per kWh)")
        import torch

        device = torch.device(device)
        self.device, self.interval, self.grid_intensity = device, float(interval), float(grid_intensity)
        self.samples: list[dict] = []
        self.available, self.reason, self.source = False, "", None
        self._nvml = self._handle = self._rapl = self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if device.type == "cuda":
            self._open_nvml(_nvml_index(cuda_index(device)))  # "cuda" is the current device, cuda:1 in rank 1
        else:
            try:
                self._rapl = _Rapl(rapl_root if rapl_root is not None else RAPL_ROOT)
                self.available, self.source = True, "RAPL"
            except MonitorUnavailable as error:
                self.reason = f"CPU energy not available: {error}; no GPU to ask NVML"
        if not self.available and strict:
            raise MonitorUnavailable(self.reason)

    def _open_nvml(self, index: int) -> None:
        try:
            import pynvml
        except ImportError:
            self.reason = "GPU monitor not available: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as error:
            self.reason = f"GPU monitor not available: NVML cannot reach GPU {index} ({error})"
            return
        self._nvml, self.available = pynvml, True
        self.source = "energy counter" if self._energy_mj() is not None else "integrated power"

    def __repr__(self) -> str:
        state = f"{self.source}, {len(self.samples)} samples" if self.available else self.reason
        return f"Monitor({self.device}, every {self.interval:g} s: {state})"

    # -- sampling -----------------------------------------------------------------------------

    def _ask(self, name: str, *args):
        try:
            return getattr(self._nvml, name)(self._handle, *args)
        except (self._nvml.NVMLError, AttributeError):  # not supported on this GPU, driver or binding
            return None

    def _energy_mj(self) -> int | None:
        return self._ask("nvmlDeviceGetTotalEnergyConsumption")  # mJ since the driver loaded

    def sample(self) -> dict:
        """One reading now (values the GPU cannot give are left out)."""
        nvml = self._nvml
        utilization, memory = self._ask("nvmlDeviceGetUtilizationRates"), self._ask("nvmlDeviceGetMemoryInfo")
        power = self._ask("nvmlDeviceGetPowerUsage")  # mW
        mask = self._ask("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:
            mask = self._ask("nvmlDeviceGetCurrentClocksThrottleReasons")  # older drivers and bindings
        row = {
            "t": time.perf_counter() - self._started,
            "utilization": None if utilization is None else utilization.gpu,  # %
            "memory_used": None if memory is None else memory.used,  # bytes
            "power_w": None if power is None else power / 1000,
            "temperature_c": self._ask("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU),
            "sm_clock_mhz": self._ask("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM),
            "memory_clock_mhz": self._ask("nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM),
            "reasons": None if mask is None else clock_reasons(mask),
        }
        return {key: value for key, value in row.items() if value is not None}

    def _run(self) -> None:
        while not self._stop.is_set():
            row = self.sample()
            with self._lock:
                self.samples.append(row)
            self._stop.wait(self.interval)

    def start(self) -> Monitor:
        """Start sampling (a daemon thread); a monitor that is not available does nothing."""
        self._started = time.perf_counter()
        self._lap_started, self._lap_index = 0.0, 0
        if not self.available:
            return self
        self._lap_energy = self._read_energy()
        if self._nvml is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpukit-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- segments -----------------------------------------------------------------------------

    def _read_energy(self):
        if self._rapl is not None:
            return self._rapl.read()
        return self._energy_mj() if self.source == "energy counter" else None

    def lap(self) -> Segment:
        """Close the segment since start() or the previous lap: its energy, means and reasons.

        It samples once more first, so that a segment shorter than the interval (an epoch of 50 ms
        on a fast GPU) still has a reading of power, utilisation and clocks.
        """
        if self._thread is not None:
            row = self.sample()
            with self._lock:
                self.samples.append(row)
        now = time.perf_counter() - self._started  # after that sample: it belongs to this segment
        segment = Segment(seconds=now - self._lap_started)
        if self.available:
            energy = self._read_energy()
            if self._rapl is not None:
                segment.energy_j, segment.energy_source = self._rapl.joules(self._lap_energy, energy), "RAPL"
                segment.mean_power_w = segment.energy_j / segment.seconds if segment.seconds > 0 else None
            else:
                self._summarise(segment, energy)
            self._lap_energy = energy
        self._lap_started = now
        return segment

    def _summarise(self, segment: Segment, energy) -> None:
        with self._lock:
            rows = [row for row in self.samples if row["t"] >= self._lap_started]
        segment.samples = len(rows)
        powers = [(row["t"], row["power_w"]) for row in rows if "power_w" in row]
        utilization = [row["utilization"] for row in rows if "utilization" in row]
        if utilization:
            segment.mean_utilization = sum(utilization) / len(utilization)
        if powers:
            segment.mean_power_w = sum(power for _, power in powers) / len(powers)
        if energy is not None and self._lap_energy is not None:
            segment.energy_j, segment.energy_source = (energy - self._lap_energy) / 1000, "energy counter"  # mJ → J
        elif len(powers) >= 2:
            # Trapezoids between samples; the ends of the lap are held at the first and last power.
            inside = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(powers, powers[1:]))
            edges = (powers[0][0] - self._lap_started) * powers[0][1] + (
                self._lap_started + segment.seconds - powers[-1][0]
            ) * powers[-1][1]
            segment.energy_j, segment.energy_source = inside + max(edges, 0.0), "integrated power"
        seen = [reason for row in rows for reason in row.get("reasons", [])]
        segment.throttle_reasons = [reason for reason in dict.fromkeys(seen) if reason not in BENIGN_CLOCK_REASONS]

    def co2_grams(self, joules: float) -> float:
        """Grams of CO₂ for `joules` at this monitor's grid intensity (g/kWh)."""
        return joules_to_co2_grams(joules, self.grid_intensity)

    def plot(self):
        """Utilisation, power, temperature and SM clock over time (one panel each that was sampled)."""

        return plot_monitor(self.samples)
