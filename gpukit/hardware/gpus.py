"""One table of NVIDIA GPUs: memory, bandwidth, dense tensor TFLOP/s, compute capability, TDP.

Every figure is a datasheet's (the source is given per row). Tensor figures are *dense*: NVIDIA's
sheets for Ampere and later quote "with sparsity" numbers (2:4 structured sparsity), and dense is
half of those; where a row's dense figure is such a half, its comment says so. GeForce cards run
tensor matmuls with fp32 accumulation (what PyTorch uses) at half the fp16-accumulate rate; their
rows give the fp32-accumulate figure.

`peak_tflops` (gk.bench), MFU, the doctor and `gk.hardware.plan` all read this table. Add a GPU or
override a row with `add_gpu(GPU(...))`; `find_gpu(device_name)` matches the names drivers report
("NVIDIA H100 80GB HBM3", "Tesla T4", …), `get_gpu(name)` takes the table's own names.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from ..precision import matmul_format
from ..report import Table


@dataclass(frozen=True)
class GPU:
    """One GPU model as its datasheet describes it.

    name: the table's name ("H100 SXM"); match: word patterns that identify it in a driver's device
    name, most specific first ("H100 HBM3" matches "NVIDIA H100 80GB HBM3"). TFLOP/s are dense
    (no sparsity); None where the GPU has no tensor cores for that precision.
    """

    name: str
    # GB as the datasheet says, counted as 10^9 bytes: conservative, since an "80 GB" H100 shows
    # 79.6 GiB (85.5·10^9 bytes) to the driver.
    memory_gb: float
    bandwidth_tbs: float  # TB/s of memory bandwidth (10^12 bytes/s)
    fp32: float  # TFLOP/s of plain fp32 (CUDA cores, not tensor cores)
    tf32: float | None  # TFLOP/s of tf32 tensor-core matmuls (Ampere and later)
    bf16: float | None  # TFLOP/s of bf16 tensor-core matmuls (Ampere and later)
    fp16: float | None  # TFLOP/s of fp16 tensor-core matmuls (Volta and later)
    fp8: float | None  # TFLOP/s of fp8 tensor-core matmuls (Ada, Hopper and later)
    compute_capability: tuple[int, int]
    tdp_w: float  # W: thermal design power (board power for GeForce cards)
    match: tuple[str, ...] = field(default=())

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    @property
    def supports_bf16(self) -> bool:
        return self.bf16 is not None

    @property
    def supports_fp8(self) -> bool:
        return self.fp8 is not None

    def peak_tflops(self, precision: str = "bf16-mixed") -> float | None:
        """Dense peak TFLOP/s of the matmuls of a precision ("fp32", "tf32", "bf16-mixed", "fp16-mixed",
        or "fp8"); None where this GPU has no such units."""
        return getattr(self, matmul_format(precision))

    def row(self) -> dict:
        """A row for a Table."""
        return {
            "gpu": self.name,
            "memory GB": self.memory_gb,
            "bandwidth TB/s": self.bandwidth_tbs,
            "bf16 TFLOP/s": self.bf16,
            "fp16 TFLOP/s": self.fp16,
            "tf32 TFLOP/s": self.tf32,
            "fp8 TFLOP/s": self.fp8,
            "fp32 TFLOP/s": self.fp32,
            "compute capability": "{}.{}".format(*self.compute_capability),
            "bf16": self.supports_bf16,
            "fp8": self.supports_fp8,
            "TDP W": self.tdp_w,
        }


# Dense tensor TFLOP/s. "(½ of N sparse)" marks a dense figure that is half the sheet's sparsity figure.
_DEFAULTS = [
    # NVIDIA T4 datasheet (2019): 16 GB GDDR6, 320 GB/s, 8.1 FP32, 65 FP16 mixed (Turing: no sparsity,
    # no tf32/bf16), 70 W.
    GPU("T4", 16, 0.32, 8.1, None, None, 65.0, None, (7, 5), 70, ("T4",)),
    # NVIDIA L4 datasheet (2023): 24 GB GDDR6, 300 GB/s, 30.3 FP32, tf32 60 (½ of 120 sparse),
    # bf16/fp16 121 (½ of 242 sparse), fp8 242.5 (½ of 485 sparse), 72 W.
    GPU("L4", 24, 0.30, 30.3, 60.0, 121.0, 121.0, 242.5, (8, 9), 72, ("L4",)),
    # NVIDIA A10 datasheet (2021): 24 GB GDDR6, 600 GB/s, 31.2 FP32, tf32 62.5 (½ of 125 sparse),
    # bf16/fp16 125 (½ of 250 sparse), 150 W.
    GPU("A10", 24, 0.60, 31.2, 62.5, 125.0, 125.0, None, (8, 6), 150, ("A10",)),
    # A10G: AWS's variant of the A10 (same GA102 chip, 24 GB, 600 GB/s) in G5 instances. NVIDIA
    # publishes no datasheet for it; these are the A10 sheet's figures: treat them as approximate
    # and override the row if you have measured yours. Its 300 W is the figure public GPU databases
    # (TechPowerUp) give, not an NVIDIA one.
    GPU("A10G", 24, 0.60, 31.2, 62.5, 125.0, 125.0, None, (8, 6), 300, ("A10G",)),
    # NVIDIA L40 datasheet (2022): 48 GB GDDR6, 864 GB/s, 90.5 FP32, tf32 90.5 (½ of 181 sparse),
    # bf16/fp16 181 (½ of 362 sparse), fp8 362 (½ of 724 sparse), 300 W.
    GPU("L40", 48, 0.864, 90.5, 90.5, 181.0, 181.0, 362.0, (8, 9), 300, ("L40",)),
    # NVIDIA L40S datasheet (2023): 48 GB GDDR6, 864 GB/s, 91.6 FP32, tf32 183 (½ of 366 sparse),
    # bf16/fp16 362 (the sheet's dense 362.05; its sparse 733 is not quite twice that), fp8 733
    # (½ of 1,466 sparse), 350 W.
    GPU("L40S", 48, 0.864, 91.6, 183.0, 362.0, 362.0, 733.0, (8, 9), 350, ("L40S",)),
    # NVIDIA A100 datasheet (2021), SXM: 19.5 FP32, tf32 156 (½ of 312 sparse), bf16/fp16 312
    # (½ of 624 sparse), 400 W; 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s (the PCIe
    # 80 GB has 1,935 GB/s and 300 W: override the row for it).
    GPU("A100 40GB", 40, 1.555, 19.5, 156.0, 312.0, 312.0, None, (8, 0), 400, ("A100 40GB", "A100")),
    GPU("A100 80GB", 80, 2.039, 19.5, 156.0, 312.0, 312.0, None, (8, 0), 400, ("A100 80GB",)),
    # NVIDIA H100 datasheet (2023), SXM: 80 GB HBM3, 3.35 TB/s, 67 FP32, tf32 494.7 (½ of 989 sparse),
    # bf16/fp16 989.4 (½ of 1,979 sparse), fp8 1,979 (½ of 3,958 sparse), up to 700 W. Drivers call
    # it "NVIDIA H100 80GB HBM3".
    GPU("H100 SXM", 80, 3.35, 67.0, 494.7, 989.4, 989.4, 1979.0, (9, 0), 700, ("H100 SXM", "H100 HBM3", "H100")),
    # Same sheet, PCIe: 80 GB HBM2e, 2.0 TB/s, 51 FP32, tf32 378 (½ of 756 sparse), bf16/fp16 756
    # (½ of 1,513 sparse), fp8 1,513 (½ of 3,026 sparse), 300–350 W.
    GPU("H100 PCIe", 80, 2.0, 51.0, 378.0, 756.0, 756.0, 1513.0, (9, 0), 350, ("H100 PCIe",)),
    # Same sheet, H100 NVL per GPU: 94 GB HBM3, 3.9 TB/s, 60 FP32, tf32 417.5 (½ of 835 sparse),
    # bf16/fp16 835 (½ of 1,671 sparse), fp8 1,670 (½ of 3,341 sparse), 350–400 W.
    GPU("H100 NVL", 94, 3.9, 60.0, 417.5, 835.0, 835.0, 1670.0, (9, 0), 400, ("H100 NVL",)),
    # NVIDIA H200 datasheet (2024), SXM: 141 GB HBM3e, 4.8 TB/s, the H100 SXM's compute (67 FP32,
    # tf32 494.7, bf16/fp16 989.4, fp8 1,979: ½ of the sheet's sparse 989/1,979/3,958), up to 700 W.
    GPU("H200", 141, 4.8, 67.0, 494.7, 989.4, 989.4, 1979.0, (9, 0), 700, ("H200",)),
    # NVIDIA HGX B200 datasheet (2024), per GPU of the 8: 180 GB HBM3e (1.44 TB for 8), 8 TB/s,
    # 75 FP32 (600 for 8), tf32 1,125 (½ of 18 PFLOPS/8 sparse), bf16/fp16 2,250 (½ of 36 PFLOPS/8
    # sparse), fp8 4,500 (½ of 72 PFLOPS/8 sparse), up to 1,000 W.
    GPU("B200", 180, 8.0, 75.0, 1125.0, 2250.0, 2250.0, 4500.0, (10, 0), 1000, ("B200",)),
    # NVIDIA Tesla V100 datasheet (2018): 16 or 32 GB HBM2 at 900 GB/s; SXM2 15.7 FP32, 125 fp16
    # tensor, 300 W; PCIe 14 FP32, 112 fp16 tensor, 250 W (Volta: no tf32, bf16 or sparsity).
    GPU("V100", 16, 0.90, 15.7, None, None, 125.0, None, (7, 0), 300, ("V100 SXM2", "V100")),
    GPU("V100 PCIe", 16, 0.90, 14.0, None, None, 112.0, None, (7, 0), 250, ("V100 PCIe",)),
    # NVIDIA Ampere GA102 whitepaper (2020), RTX 3090: 24 GB GDDR6X, 936 GB/s, 35.6 FP32, tf32 35.6
    # (½ of 71 sparse), fp16/bf16 with fp32 accumulate 71 (½ of 142 sparse), 350 W.
    GPU("RTX 3090", 24, 0.936, 35.6, 35.6, 71.0, 71.0, None, (8, 6), 350, ("RTX 3090",)),
    # NVIDIA Ada Lovelace architecture whitepaper (2022), RTX 4090: 24 GB GDDR6X, 1,008 GB/s, 82.6
    # FP32, tf32 82.6 (½ of 165.2 sparse), fp16/bf16 with fp32 accumulate 165.2 (½ of 330.3 sparse),
    # fp8 with fp32 accumulate 330.3 (½ of 660.6 sparse), 450 W.
    GPU("RTX 4090", 24, 1.008, 82.6, 82.6, 165.2, 165.2, 330.3, (8, 9), 450, ("RTX 4090",)),
    # NVIDIA RTX Blackwell GPU architecture whitepaper (2025), RTX 5090: 32 GB GDDR7, 1,792 GB/s,
    # 104.8 FP32, tf32 104.8 (½ of 209.5 sparse), fp16/bf16 with fp32 accumulate 209.5 (½ of 419
    # sparse), fp8 with fp32 accumulate 419 (½ of 838 sparse), 575 W.
    GPU("RTX 5090", 32, 1.792, 104.8, 104.8, 209.5, 209.5, 419.0, (12, 0), 575, ("RTX 5090",)),
]

GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in _DEFAULTS}


def add_gpu(gpu: GPU) -> GPU:
    """Add a GPU to the table, or replace the row of the same name (e.g. your A100 PCIe 80 GB).

    Without `match` patterns the GPU is matched by its own name. Returns the row as stored.
    """
    if not isinstance(gpu, GPU):
        raise TypeError(f"add_gpu takes a gk.hardware.GPU, got {type(gpu).__name__}.")
    for name in ("memory_gb", "bandwidth_tbs", "fp32", "tdp_w"):
        if not getattr(gpu, name) > 0:
            raise ValueError(f"{gpu.name}: {name} must be positive, got {getattr(gpu, name)!r}.")
    if not gpu.match:
        gpu = GPU(**{**gpu.__dict__, "match": (gpu.name,)})
    GPUS[gpu.name] = gpu
    return gpu


def reset_gpus() -> None:
    """Back to the datasheet rows above (undoes add_gpu)."""
    GPUS.clear()
    GPUS.update({gpu.name: gpu for gpu in _DEFAULTS})


def _words(text: str) -> set[str]:
    return set(re.split(r"[\s_-]+", text.upper())) - {""}


def find_gpu(device_name: str) -> GPU | None:
    """The table's row for a driver's device name ("NVIDIA A100-SXM4-80GB", "Tesla T4"), or None.

    Whole words only (so "L40" is not "L4"), the most specific pattern first; a name with a
    suffix the pattern lacks ("Ti", "Super") is another GPU.
    """
    words = _words(device_name)
    candidates = []
    for order, gpu in enumerate(GPUS.values()):
        for pattern in gpu.match or (gpu.name,):
            pattern_words = _words(pattern)
            variant = any(suffix in words and suffix not in pattern_words for suffix in ("TI", "SUPER"))
            if pattern_words <= words and not variant:
                candidates.append((-len(pattern_words), order, gpu))
    return min(candidates, key=lambda item: item[:2])[2] if candidates else None


def get_gpu(name: str | GPU) -> GPU:
    """A GPU by the table's name ("H100 SXM", case-insensitive) or a driver's device name ("NVIDIA
    H100 80GB HBM3", "Tesla T4"); a GPU passes through.

    Raises ValueError naming the closest known GPUs when there is no such row.
    """
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a GPU is named by a string such as 'H100 SXM', got {type(name).__name__}.")
    by_name = {key.upper(): gpu for key, gpu in GPUS.items()}
    found = by_name.get(name.strip().upper())
    if found is None and name.strip().upper().startswith(("NVIDIA", "TESLA")):  # a driver's name for it
        found = find_gpu(name)
    if found is not None:
        return found
    close = difflib.get_close_matches(name.upper(), list(by_name), n=3, cutoff=0.4)
    hint = f" Did you mean {', '.join(repr(by_name[key].name) for key in close)}?" if close else ""
    raise ValueError(
        f"no GPU called {name!r} in the table.{hint} Known: {', '.join(GPUS)}. "
        "Add yours with gk.hardware.add_gpu(gk.hardware.GPU(...))."
    )


def gpu_table():
    """The GPU table as a gk.Table (one row per GPU)."""
    return Table([gpu.row() for gpu in GPUS.values()], title="GPUs (dense tensor TFLOP/s, from datasheets)")
