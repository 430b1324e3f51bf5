"""A cost model of data-parallel training: how efficiency falls as GPUs are added.

Each step, every GPU computes forward and backward on its own batch (compute time T, the same
for any number of GPUs: weak scaling) and the gradients (S bytes) are all-reduced. A ring
all-reduce over n GPUs on links of bandwidth B with a per-step latency α takes

    t_allreduce(S, n) = 2(n−1)/n · S/B + 2(n−1)·α     (per bucket for the latency term)

DDP all-reduces buckets of gradients while backward still runs, so communication hides behind
the backward pass (about 2/3 of T) except for what does not fit under it, and at least the last
bucket, which is only ready when backward ends:

    exposed = max(t_allreduce − backward, t_last_bucket),   step = T + exposed,
    efficiency = T / step   (throughput per GPU relative to one GPU).

It is an upper bound: stragglers, data loading, and NCCL's choice of algorithm (trees rather
than rings across many nodes, which makes the latency term grow as log n) are not in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class Interconnect:
    """A link between GPUs. bandwidth: bytes/s per direction per GPU; latency: s per ring step."""

    name: str
    bandwidth: float
    latency: float
    note: str = ""


# Nominal per-direction link rates (what a ring can use at best); measured NCCL bus bandwidth is
# usually 70–90% of these. Latencies are typical orders of magnitude, not measurements.
INTERCONNECTS = {
    "NVLink 2 (DGX-1, V100)": Interconnect("NVLink 2 (DGX-1, V100)", 150e9, 5e-6, "6 links × 25 GB/s per direction"),
    "NVLink 4 (H100 SXM)": Interconnect("NVLink 4 (H100 SXM)", 450e9, 5e-6, "900 GB/s total, both directions"),
    "PCIe 4.0 x16": Interconnect("PCIe 4.0 x16", 32e9, 10e-6, "about 32 GB/s per direction"),
    "400 Gb/s InfiniBand": Interconnect("400 Gb/s InfiniBand", 50e9, 10e-6, "NDR, one NIC per GPU"),
    "100 Gb/s InfiniBand": Interconnect("100 Gb/s InfiniBand", 12.5e9, 10e-6, "EDR"),
    "25 Gb/s Ethernet": Interconnect("25 Gb/s Ethernet", 3.125e9, 30e-6, "RoCE, as in Horovod's benchmark"),
}


@dataclass(frozen=True)
class Workload:
    """A model on one GPU: gradient bytes per step and compute seconds per step."""

    name: str
    gradient_bytes: float
    compute_time: float
    source: str = ""


# Published single-GPU throughputs turned into compute time per step (batch / images per second).
WORKLOADS = {
    "ResNet-50, V100, fp32": Workload(
        "ResNet-50, V100, fp32",
        25.6e6 * 4,
        112 / 367,
        "NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README: 367 img/s on 1 V100 (FP32, batch 112)",
    ),
    "ResNet-50, V100, mixed precision": Workload(
        "ResNet-50, V100, mixed precision",
        25.6e6 * 4,
        256 / 1200,
        "NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README: 1200 img/s on 1 V100 (AMP, batch 256)",
    ),
    "ResNet-101, P100 (Horovod)": Workload(
        "ResNet-101, P100 (Horovod)",
        44.5e6 * 4,
        64 / (1656.82 / 16),
        "Horovod docs/benchmarks.md: batch 64, 1656.82 img/s on 16 GPUs (about 104 img/s per GPU)",
    ),
}


@dataclass(frozen=True)
class Published:
    """A measured scaling efficiency from the literature, with where it comes from."""

    label: str
    gpus: int
    efficiency: float  # throughput per GPU relative to one GPU
    interconnect: str
    workload: str
    source: str


PUBLISHED = (
    Published(
        "ResNet-50 fp32, 8 V100 (DDP)",
        8,
        2855 / (8 * 367),
        "NVLink 2 (DGX-1, V100)",
        "ResNet-50, V100, fp32",
        "NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5 README, 'Training performance: "
        "NVIDIA DGX-1 16GB (8x V100 16GB)': 367 img/s on 1 GPU, 2855 img/s on 8 (7.76x)",
    ),
    Published(
        "ResNet-50 mixed precision, 8 V100 (DDP)",
        8,
        8322 / (8 * 1200),
        "NVLink 2 (DGX-1, V100)",
        "ResNet-50, V100, mixed precision",
        "same table: 1200 img/s on 1 GPU, 8322 img/s on 8 (6.93x)",
    ),
    Published(
        "ResNet-101, 512 P100 (Horovod)",
        512,
        0.90,
        "25 Gb/s Ethernet",
        "ResNet-101, P100 (Horovod)",
        "Sergeev & Del Balso 2018, 'Horovod: fast and easy distributed deep learning in TensorFlow' "
        "(arXiv:1802.05799), and Horovod's README: 90% scaling efficiency on 128 servers x 4 Pascal GPUs, "
        "25 Gbit/s RoCE",
    ),
)


def ring_allreduce_time(size_bytes: float, gpus: int, bandwidth: float, latency: float, buckets: int = 1) -> float:
    """Seconds for a ring all-reduce of `size_bytes` over `gpus`, sent in `buckets` pieces."""
    if gpus < 1 or bandwidth <= 0 or latency < 0:
        raise ValueError(f"need gpus >= 1, bandwidth > 0, latency >= 0; got {gpus}, {bandwidth}, {latency}.")
    if gpus == 1:
        return 0.0
    return 2 * (gpus - 1) / gpus * size_bytes / bandwidth + buckets * 2 * (gpus - 1) * latency


def predict(
    compute_time: float,
    gradient_bytes: float,
    gpus: Sequence[int],
    bandwidth: float,
    latency: float,
    *,
    bucket_bytes: float = 25 * MiB,
    backward_fraction: float = 2 / 3,
    overlap: bool = True,
) -> list[dict]:
    """Predicted step time and efficiency of data-parallel training for each GPU count.

    compute_time: seconds of forward + backward (+ optimizer) for one GPU's batch (measured).
    gradient_bytes: bytes all-reduced per step (4 × parameters in float32; half with fp16 compression).
    bandwidth, latency: the link (measured with `scaling.fit_link`, or an `INTERCONNECTS` entry).
    overlap: DDP's bucketing lets communication run during backward; False adds it all after.
    """
    if compute_time <= 0 or gradient_bytes <= 0:
        raise ValueError(f"compute_time and gradient_bytes must be positive, got {compute_time} and {gradient_bytes}.")
    buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
    last_bucket = gradient_bytes - (buckets - 1) * bucket_bytes
    rows = []
    for count in gpus:
        communication = ring_allreduce_time(gradient_bytes, count, bandwidth, latency, buckets)
        if overlap and count > 1:
            tail = ring_allreduce_time(last_bucket, count, bandwidth, latency)
            exposed = max(communication - backward_fraction * compute_time, tail)
        else:
            exposed = communication
        step = compute_time + exposed
        rows.append(
            {
                "gpus": count,
                "communication": communication,
                "exposed": exposed,
                "step_time": step,
                "efficiency": compute_time / step,
            }
        )
    return rows


def predict_workload(workload: Workload, interconnect: Interconnect, gpus: Sequence[int], **options) -> list[dict]:
    """`predict` for a published workload on a named interconnect."""
    return predict(
        workload.compute_time, workload.gradient_bytes, gpus, interconnect.bandwidth, interconnect.latency, **options
    )
