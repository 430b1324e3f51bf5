"""gpukit's CUDA-only code, run on the fake GPU of tests/fake_cuda.py (the `fake_cuda` fixture).

These tests check that gpukit calls torch's CUDA API in ways torch accepts and handles what comes back; the
numbers they see are the fake's, so they say nothing about what a GPU measures (the @pytest.mark.gpu tests do).
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import CONTEXT_BYTES, T4, GiB

from gpukit import memory
from gpukit.memory import allocator

CUDA = torch.device("cuda")  # what gk.fit and the tools get from device="cuda": no index

two_t4 = pytest.mark.parametrize("fake_cuda", [[T4, T4]], indirect=True, ids=["2xT4"])


# ---------------------------------------------------------------------------------------------
# The allocator: memory cap, out-of-memory message, expandable segments, snapshots


@pytest.mark.parametrize("device", [None, "cuda", CUDA, "cuda:0"])
def test_limit_gpu_memory_caps_this_process_and_restores(fake_cuda, device):
    with memory.limit_gpu_memory(0.25, device) as cap:
        assert cap == 20 * GiB  # a quarter of the fake's 80 GiB
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.25
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            fake_cuda.allocate(21 * GiB)
        fake_cuda.free(fake_cuda.allocate(19 * GiB))
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    assert fake_cuda.called("_cuda_setMemoryFraction") == [(0.25, 0), (1.0, 0)]
    assert fake_cuda.called("_cuda_emptyCache")  # cached blocks beyond the cap are returned first


def test_limit_gpu_memory_in_bytes_and_its_bounds(fake_cuda):
    with memory.limit_gpu_memory(16 * GiB) as cap:
        assert cap == 16 * GiB and torch.cuda.get_per_process_memory_fraction(0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="up to the GPU's 80.0 GiB"):
        with memory.limit_gpu_memory(100 * GiB):
            pass
    assert fake_cuda.called("_cuda_setMemoryFraction") == [(0.2, 0), (1.0, 0)]  # nothing set by the refused one


@two_t4
def test_limit_gpu_memory_acts_on_the_device_asked_for(fake_cuda):
    with memory.limit_gpu_memory(0.5, "cuda:1"):
        assert [torch.cuda.get_per_process_memory_fraction(i) for i in (0, 1)] == [1.0, 0.5]
    torch.cuda.set_device(1)  # an index-less "cuda" is the current device
    with memory.limit_gpu_memory(4 * GiB, "cuda"):
        assert [torch.cuda.get_per_process_memory_fraction(i) for i in (0, 1)] == [1.0, 0.25]
    assert [index for _, index in fake_cuda.called("_cuda_setMemoryFraction")] == [1, 1, 1, 1]


def _out_of_memory(fake_cuda, nbytes: int) -> torch.OutOfMemoryError:
    with pytest.raises(torch.OutOfMemoryError) as caught:
        fake_cuda.allocate(nbytes)
    return caught.value


def test_out_of_memory_message_under_a_cap(fake_cuda):
    allocator.watch_out_of_memory()  # as fit does on CUDA: the allocator reports the refused size
    with memory.limit_gpu_memory(0.5):
        held = fake_cuda.allocate(30 * GiB)
        error = allocator.out_of_memory_error(_out_of_memory(fake_cuda, 20 * GiB), "forward", CUDA, batch_size=256,
                                              precision="bf16-mixed")  # fmt: skip
        fake_cuda.free(held)
    assert isinstance(error, memory.TrainingOutOfMemoryError) and isinstance(error, torch.OutOfMemoryError)
    assert (error.requested, error.total) == (20 * GiB, 40 * GiB)  # the cap, not the GPU's 80 GiB
    assert (error.allocated, error.reserved, error.free) == (30 * GiB, 30 * GiB, 10 * GiB)
    message = str(error)
    assert "out of memory on cuda in the forward pass (batch 256, precision bf16-mixed)" in message
    assert "asked for 20.0 GiB while 10.0 GiB of 40.0 GiB was free under this process's memory cap" in message
    assert "batch_size=128, accumulate=2" in message and "PyTorch said: CUDA out of memory" in message
    assert allocator._refused == {}  # read once: the next error does not report this size


def test_out_of_memory_message_without_a_cap_or_an_observer(fake_cuda):
    error = allocator.out_of_memory_error(_out_of_memory(fake_cuda, 90 * GiB), "optimizer step", CUDA,
                                          batch_size=64, accumulate=4)  # fmt: skip
    assert error.requested is None and (error.free, error.total) == (80 * GiB - CONTEXT_BYTES, 80 * GiB)
    assert "asked for more while" in str(error) and "on the GPU" in str(error) and "× accumulate 4" in str(error)
    assert "optimizer='sgd'" in str(error)
