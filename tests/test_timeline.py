"""gk.data.timeline's device rows, from profiler events built by hand (no GPU needed): only kernels are compute."""

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from gpukit.data.timeline import _intervals, device_row

CUDA, CPU = DeviceType.CUDA, DeviceType.CPU


def event(name, start_us, end_us, device_type=CUDA, activity=None, annotation=False):
    """A FunctionEvent as torch's profiler builds it from a Kineto event. activity_type and is_user_annotation are
    set after construction: a torch without the activity_type argument still gets the attribute or its absence."""
    made = FunctionEvent(id=0, name=name, thread=0, start_us=start_us, end_us=end_us, device_type=device_type)
    made.is_user_annotation = annotation
    made.activity_type = activity
    return made


def two_steps(with_activity: bool):
    """Two traced steps (times in µs). Expected, by hand: copies 2,000 µs + 1,000 µs; kernels at 2,000–4,000 and
    6,000–7,000. The first copy (3,000–5,000) runs under the first kernel for 1,000 µs, the second (8,000–9,000)
    under none: 1,000 / 3,000 of the copy time hidden."""

    def kind(activity):
        return activity if with_activity else None

    return [
        event("data wait", 0, 1_000, CPU, annotation=True),  # the host's phases
        event("step", 1_000, 5_000, CPU, annotation=True),
        event("data wait", 5_000, 5_500, CPU, annotation=True),
        event("step", 5_500, 9_500, CPU, annotation=True),
        # Kineto's GPU user annotations: device type CUDA, spanning every kernel launched inside them.
        event("step", 0, 10_000, annotation=True, activity=kind("gpu_user_annotation")),
        event("ProfilerStep*", 0, 10_000, annotation=True, activity=kind("gpu_user_annotation")),
        event("void at::native::conv_kernel<float>", 2_000, 4_000, activity=kind("kernel")),
        event("ampere_sgemm_128x64_nn", 6_000, 7_000, activity=kind("kernel")),
        event("Memcpy HtoD (Pinned -> Device)", 3_000, 5_000, activity=kind("gpu_memcpy")),
        event("Memcpy HtoD (Pageable -> Device)", 8_000, 9_000, activity=kind("gpu_memcpy")),
        # Not kernels, and each would hide part of the second copy if it counted as compute:
        event("Memcpy DtoH (Device -> Pinned)", 7_500, 8_500, activity=kind("gpu_memcpy")),
        event("Memset (Device)", 8_500, 9_000, activity=kind("gpu_memset")),
        event("Context Sync", 0, 10_000, activity=kind("cuda_sync")),
    ]


@pytest.mark.parametrize("with_activity", [True, False], ids=["activity_type", "names only"])
def test_only_kernels_count_as_compute(with_activity):
    trace = _intervals(two_steps(with_activity), steps=2, device="cuda:0", path=None)
    assert trace.hidden_copy_fraction() == pytest.approx(1 / 3)
    assert trace.rows["compute"] == [(2.0, 2.0), (6.0, 1.0)]  # ms from the trace's start: the kernels alone
    assert trace.rows["copy"] == [(3.0, 2.0), (8.0, 1.0)]
    assert trace.rows["data wait"] == [(0.0, 1.0), (5.0, 0.5)]  # the host rows: CPU events only
    assert trace.rows["step"] == [(1.0, 4.0), (5.5, 4.0)]


def test_the_device_row_of_each_kind_of_event():
    assert device_row(event("Memcpy HtoD (Pinned -> Device)", 0, 1, activity="gpu_memcpy")) == "copy"
    assert device_row(event("Memcpy DtoD (Device -> Device)", 0, 1)) is None
    assert device_row(event("triton_poi_fused_add_0", 0, 1, activity="kernel")) == "compute"
    assert device_row(event("triton_poi_fused_add_0", 0, 1)) == "compute"  # a torch without activity_type
    # A user's own record_function span, seen on the device: flagged, whatever its name.
    assert device_row(event("my forward", 0, 1, annotation=True)) is None
    assert device_row(event("my forward", 0, 1, activity="gpu_user_Annotation")) is None  # Kineto's old spelling
    assert device_row(event("void kernel", 0, 1, CPU)) is None  # host events have rows of their own
