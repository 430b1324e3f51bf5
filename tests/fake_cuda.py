"""A fake CUDA GPU at torch's lowest layer, so that gpukit's CUDA-only code runs on a machine without one.

It checks calls and argument handling, not numbers: every byte count, time and clock it reports is made up
(plausibly), so a test through it proves that gpukit calls torch's CUDA API the way torch accepts it and
handles what comes back, never that a GPU would measure what the test sees.

Only the layer under torch.cuda's Python functions is replaced (see `FakeCuda.install`):
- `torch.cuda.is_available`, `is_initialized`, `_lazy_init`, `device_count`, `_get_device_properties`
  (which torch's real initialisation defines), `_exchange_device`, `default_generators`, and the CUDA runtime
  module `torch.cuda._cudart` (`cudaMemGetInfo`), wherever a module of torch imported them by name;
- the C bindings `torch._C._cuda_*` that torch.cuda and torch.cuda.memory call: device count and selection,
  synchronisation, allocator statistics, memory fraction, memory history and snapshots, the out-of-memory
  observer, and the current stream; and the allocator settings (`torch._C._accelerator_setAllocatorSettings`,
  and its getter, which torch 2.11 lacks: delete it to run as there);
- `torch.cuda.Stream` and `torch.cuda.Event`: CPU objects that record what is done with them; an event's time is
  the host clock when it was recorded, and `elapsed_time` raises until a synchronisation completed it, as on a GPU;
- `Tensor.to("cuda")`: a CPU copy that says it is on cuda:N (`FakeCudaTensor`: `is_cuda`, `device`,
  `record_stream`); arithmetic on it gives ordinary CPU tensors, and `Module.to("cuda")` leaves parameters on the CPU.
  `Tensor.pin_memory()` gives a copy that says it is page-locked (DataLoader pins, since torch.accelerator asks
  torch.cuda.is_available); every copy to the device is listed in `FakeCuda.copies` (non_blocking, pinned, stream);
- NVML: a fake `pynvml` module that sees the same GPUs (gpukit.detect, doctor and the Monitor ask it).
- cuBLAS's workspaces: `torch.nn.functional.linear` of a tensor on the fake GPU (a cuBLAS GEMM there) takes a
  workspace from the allocator on its first call per thread and keeps it, as cuBLAS does per (thread, stream): one
  for the calling thread, and one for autograd's device thread when its backward runs (`FakeCuda.cublas_workspaces`).
  32 MiB each on Hopper (capability 9.0), 8 MiB + 128 KiB elsewhere, as `_cuda_getCublasWorkspaceSize` reports.
Everything above stays real: get_device_properties, mem_get_info, memory_stats, max_memory_allocated,
set_per_process_memory_fraction, synchronize, current_stream, stream(), memory._record_memory_history and _snapshot
run torch's own code, including its argument checks (`_get_device_index`). That is how this layer found that
`set_per_process_memory_fraction(torch.device("cuda"))` raises ValueError.

Not faked: factory functions with device="cuda" (`torch.zeros(..., device="cuda")`, `torch.Generator("cuda")`)
fail as on any machine without a GPU, so code that allocates on the device (fit's training loop, matmul_tflops,
DeviceLoader) is tested only up to that point; `FakeCuda.allocate` and `free` stand for allocations (they move the
allocator's statistics, record history, and raise a real torch.OutOfMemoryError beyond the memory cap). Fake tensors
(FakeTensorMode) on "cuda" abort the whole process under the fake, since autograd asks the CUDA runtime for a
stream: gk.memory.estimate(device="cuda") and the planners' predictions must not run under it (tests predict for
the CPU instead). The profiler's CUDA activity (trace_steps) also needs the real runtime.

On a machine with a real GPU the fixture patches all the same, so a test sees the fake GPU and never the real one
and gives the same result everywhere; the tests create no tensor on "cuda" themselves (which would reach the real
device there).

Coverage (measured with tests/gpu_lines.py, which runs tests/test_gpu_paths.py under coverage): a statement of
gpukit is GPU-only when no CPU machine reaches it, i.e. the body of a branch taken only on CUDA (`device.type ==
"cuda"`, `torch.cuda.is_available()`), the statements after a guard that raises without a GPU or after a call
that needs one, or code only such code calls; statements that need an NVIDIA driver (NVML) are counted apart.
gpu_lines.py derives these regions from gpukit's source with `ast` (a few that no rule can see are listed there, with
the reason for each) and checks them against coverage's statement list. On this layer the tests executed 250 of 281
CUDA-only statements (89%) and 88 of 107 NVML-only ones (82%): 338 of 388 (87%), with torch 2.14.1 on 2026-11-29
(the list kept by hand before counted 307). Not reached: fit's two CUDA lines and trace_steps's synchronisation
(they follow a tensor made on the device), worker processes on the GPU (setup with nccl, data_parallel's
SyncBatchNorm, compare_parallelism, measure_contention), a torch built without NCCL, fp8's capability checks past
torch.cuda.is_available(), the CUDA generators saved in a checkpoint, the planner's free-memory read, gpu-check's
own (it never runs in the tests with a GPU), and NVML's fallbacks for old drivers (throttle-reason name, no energy
counter, failed queries).

torch versions: the fake follows torch's C bindings where torch 2.11 (the lent GPU machines') and 2.14 differ, e.g.
_cuda_record_memory_history's eight or ten arguments; `make fake-cuda-old-torch` runs the fake-GPU tests under 2.11.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field

import torch

GiB, MiB = 2**30, 2**20
CONTEXT_BYTES = 512 * MiB  # what the CUDA context itself takes on each GPU: mem_get_info's free is less than total
SEGMENT = 2 * MiB  # the caching allocator reserves device memory in segments of this size (small ones)
BLOCK = 512  # and rounds every allocation up to a multiple of this
CUDA_DEVICE_TYPE = 1  # c10::DeviceType::CUDA, the third item of what _cuda_getCurrentStream returns


@dataclass(frozen=True)
class FakeGPU:
    name: str = "NVIDIA H100 80GB HBM3"
    total_memory: int = 80 * GiB
    capability: tuple[int, int] = (9, 0)
    multi_processor_count: int = 132
    power_w: float = 300.0  # what NVML reports it draws


H100 = FakeGPU()
T4 = FakeGPU("Tesla T4", 16 * GiB, (7, 5), 40, power_w=60.0)


@dataclass
class DeviceProperties:
    """The fields of torch._C._CudaDeviceProperties that code reads."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    warp_size: int = 32
    L2_cache_size: int = 50 * MiB


@dataclass
class Allocator:
    """One device's caching-allocator statistics (bytes) and settings."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    fraction: float = 1.0
    num_ooms: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # address → rounded size
    trace: list[dict] = field(default_factory=list)


_active: FakeCuda | None = None  # the installed fake (set through monkeypatch, so undone after each test)


def _index(value, what: str) -> int:
    """The C bindings take a plain int device index; anything else is a TypeError there."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}(): argument 'device' must be int, not {type(value).__name__}")
    return value


def _fake() -> FakeCuda:
    if _active is None:
        raise RuntimeError("the fake CUDA layer is not installed; use the fake_cuda fixture.")
    return _active


class FakeCuda:
    """The fake GPUs' state, and every call torch made to the faked layer (`calls`, `called(name)`)."""

    def __init__(self, gpus: tuple[FakeGPU, ...] | list[FakeGPU] = (H100,), *, allocator_backend: str = "native"):
        if not gpus:
            raise ValueError("a fake CUDA machine needs at least one FakeGPU.")
        self.gpus = list(gpus)
        self.allocator_backend = allocator_backend  # "cudaMallocAsync": PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
        self.current = 0  # the current device index
        self.initialized = False
        self.contexts: set[int] = set()  # devices this process made a CUDA context on (NVML lists it there)
        self.calls: list[tuple[str, tuple]] = []
        self.allocators = [Allocator() for _ in self.gpus]
        self.history: dict | None = None  # the settings of _record_memory_history while it records
        self.observers: list = []  # out-of-memory observers, called as (device, bytes asked, limit, free)
        self.current_streams = [0] * len(self.gpus)  # stream id per device; 0 is the default stream
        self.stream_count = 0
        self.events = 0  # events recorded so far, numbered from 1
        self.completed = [0] * len(self.gpus)  # per device: events up to this number have completed
        self.copies: list[dict] = []  # one per Tensor.to("cuda")
        self.nvml_initialized = 0  # nvmlInit calls not yet matched by nvmlShutdown
        self.cublas_workspaces: dict[tuple, int] = {}  # (thread, device) → the workspace's address
        self._next_address = 0x7F0000000000
        # The allocator settings torch applied last: at start-up the first of these variables that is set.
        variables = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
        self.allocator_settings = next((os.environ[name] for name in variables if name in os.environ), "")
        self.expandable_segments = self._parse_allocator_settings(self.allocator_settings, False)

    def called(self, name: str) -> list[tuple]:
        """The arguments of every call to `name` (e.g. "_cuda_setMemoryFraction"), in order."""
        return [args for called, args in self.calls if called == name]

    def _record(self, name: str, *args) -> None:
        self.calls.append((name, args))

    # -- torch.cuda's lowest functions ---------------------------------------------------------

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def lazy_init(self) -> None:
        if not self.initialized:
            self._record("_lazy_init")
            self.initialized = True
        self.contexts.add(self.current)

    def device_count(self) -> int:
        return len(self.gpus)

    def properties(self, index: int) -> DeviceProperties:
        gpu = self.gpus[self._device(index, "_get_device_properties")]
        return DeviceProperties(gpu.name, gpu.total_memory, *gpu.capability, gpu.multi_processor_count)

    def _device(self, index, what: str) -> int:
        index = _index(index, what)
        if not 0 <= index < len(self.gpus):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def set_device(self, index: int) -> None:
        self.current = self._device(index, "_cuda_setDevice")
        self.lazy_init()  # the C++ binding initialises CUDA (torch::utils::device_lazy_init)

    def exchange_device(self, index: int) -> int:
        """torch.cuda.device(...).__enter__: select `index`, return the previous one (-1: no-op)."""
        if _index(index, "_cuda_exchangeDevice") < 0:
            return -1
        previous, self.current = self.current, self._device(index, "_cuda_exchangeDevice")
        self.lazy_init()  # as set_device
        return previous

    def maybe_exchange_device(self, index: int) -> int:
        """torch.cuda.device(...).__exit__: back to `index` without initialising anything."""
        if _index(index, "_cuda_maybeExchangeDevice") < 0:
            return -1
        previous, self.current = self.current, self._device(index, "_cuda_maybeExchangeDevice")
        return previous

    def synchronize(self) -> None:
        self.completed[self.current] = self.events  # every event recorded on the current device has completed

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """cudaMemGetInfo: (free, total) bytes of the whole GPU."""
        index = self._device(index, "cudaMemGetInfo")
        total = self.gpus[index].total_memory
        return total - CONTEXT_BYTES - self.allocators[index].reserved, total

    # -- the caching allocator -----------------------------------------------------------------

    def _allocator(self, index, what: str) -> Allocator:
        # The allocator has one entry per device only once CUDA is initialised; before, C++ raises this.
        index = _index(index, what)
        if not self.initialized or not 0 <= index < len(self.gpus):
            raise RuntimeError(f"Invalid device argument {index}: did you call init?")
        return self.allocators[index]

    def memory_stats(self, index: int) -> dict:
        allocator = self._allocator(index, "_cuda_memoryStats")

        def stat(current: int, peak: int) -> dict:
            return {pool: {"current": current, "peak": peak} for pool in ("all", "large_pool")}

        return {
            "allocated_bytes": stat(allocator.allocated, allocator.peak_allocated),
            "active_bytes": stat(allocator.allocated, allocator.peak_allocated),
            "reserved_bytes": stat(allocator.reserved, allocator.peak_reserved),
            "num_ooms": allocator.num_ooms,
            "num_alloc_retries": 0,
        }

    def reset_peak(self, index: int) -> None:
        allocator = self._allocator(index, "_cuda_resetPeakMemoryStats")
        allocator.peak_allocated, allocator.peak_reserved = allocator.allocated, allocator.reserved

    def empty_cache(self) -> None:
        for allocator in self.allocators if self.initialized else []:
            allocator.reserved = -(-allocator.allocated // SEGMENT) * SEGMENT  # segments still in use stay

    def set_fraction(self, fraction, index: int) -> None:
        allocator = self._allocator(index, "_cuda_setMemoryFraction")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise TypeError(
                f"_cuda_setMemoryFraction(): argument 'fraction' must be float, not {type(fraction).__name__}"
            )
        if not 0 <= fraction <= 1:
            raise RuntimeError(f"invalid fraction:{fraction}. Please set within (0, 1).")  # sic: 0 and 1 are allowed
        allocator.fraction = float(fraction)

    def set_allocator_settings(self, settings) -> None:
        """torch._C._accelerator_setAllocatorSettings: parse "key:value,..." as torch does; an option not named
        keeps its value (expandable_segments here), and the string is what the getter returns afterwards."""
        if not isinstance(settings, str):
            raise TypeError(
                f"_accelerator_setAllocatorSettings(): argument 'env' must be str, not {type(settings).__name__}"
            )
        self.expandable_segments = self._parse_allocator_settings(settings, self.expandable_segments)
        self.allocator_settings = settings

    @staticmethod
    def _parse_allocator_settings(settings: str, expandable: bool) -> bool:
        """The expandable-segments value after `settings`; refuses what torch 2.14's parser refuses."""
        known = {
            "backend", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
            "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
            "large_segment_size_mb",
        }  # fmt: skip
        for option in re.sub(r"\[[^\]]*\]", "", settings).split(","):  # no commas inside [...] lists
            if not option.strip():
                continue
            key, _, value = (part.strip() for part in option.partition(":"))
            if key not in known:
                raise ValueError(f"Unrecognized key '{key}' in Accelerator allocator config.")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '{value}'")
                expandable = value == "True"
        return expandable

    def get_fraction(self, index: int) -> float:
        return self._allocator(index, "_cuda_getMemoryFraction").fraction

    def allocate(self, nbytes: int, device: int = 0) -> int:
        """Stand for a tensor of `nbytes` the caching allocator places on `device`; returns its address.

        Beyond the memory cap (set_per_process_memory_fraction) or the GPU's memory it calls the
        out-of-memory observers and raises torch.OutOfMemoryError, as the allocator does.
        """
        self.lazy_init()  # allocating initialises CUDA, as creating a tensor does
        allocator, gpu = self.allocators[device], self.gpus[device]
        size = -(-nbytes // BLOCK) * BLOCK
        reserved = max(allocator.reserved, -(-(allocator.allocated + size) // SEGMENT) * SEGMENT)
        limit = int(allocator.fraction * gpu.total_memory)
        free = gpu.total_memory - CONTEXT_BYTES - allocator.reserved
        if reserved > min(limit, gpu.total_memory - CONTEXT_BYTES):
            allocator.num_ooms += 1
            self._trace(allocator, "oom", size, device_free=free)
            for observer in self.observers:
                observer(device, size, limit, free)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {size / MiB:.2f} MiB. GPU {device} has a total capacity of "
                f"{gpu.total_memory / GiB:.2f} GiB of which {free / MiB:.2f} MiB is free. Of the allocated memory "
                f"{allocator.allocated / MiB:.2f} MiB is allocated by PyTorch, and "
                f"{(allocator.reserved - allocator.allocated) / MiB:.2f} MiB is reserved by PyTorch but unallocated."
            )
        address, self._next_address = self._next_address, self._next_address + size
        allocator.blocks[address] = size
        allocator.allocated += size
        allocator.reserved = reserved
        allocator.peak_allocated = max(allocator.peak_allocated, allocator.allocated)
        allocator.peak_reserved = max(allocator.peak_reserved, allocator.reserved)
        self._trace(allocator, "alloc", size, addr=address)
        return address

    def free(self, address: int, device: int = 0) -> None:
        """Free what `allocate` returned; the segment stays reserved (cached) until empty_cache."""
        allocator = self.allocators[device]
        size = allocator.blocks.pop(address)
        allocator.allocated -= size
        self._trace(allocator, "free_requested", size, addr=address)
        self._trace(allocator, "free_completed", size, addr=address)

    def _trace(self, allocator: Allocator, action: str, size: int, **fields) -> None:
        if self.history is None or self.history["enabled"] != "all":  # "state" keeps no history of actions
            return
        frames = []
        if self.history["context"] is not None:
            frames = [
                {"filename": frame.filename, "line": frame.lineno, "name": frame.name}
                for frame in reversed(traceback.extract_stack(limit=12)[:-2])
            ]
        allocator.trace.append(
            {"action": action, "size": size, "stream": 0, "frames": frames, "time_us": int(time.time() * 1e6), **fields}
        )
        del allocator.trace[: -self.history["max_entries"]]  # a ring buffer of the latest entries

    def record_history(
        self,
        enabled,
        context,
        stacks,
        max_entries,
        clear_history,
        compile_context,
        global_record_annotations,
        skip_actions,
        record_pinned_host_memory=False,
        record_cuda=True,
    ) -> None:
        """torch._C._cuda_record_memory_history: the C++ binding's eight positional arguments in torch 2.11 (the lent
        GPU machines'), ten in torch 2.14 (record_pinned_host_memory and record_cuda added; 2.11's behaviour is their
        defaults). torch.cuda.memory._record_memory_history passes what its own version's binding takes."""
        if enabled not in (None, "state", "all") or context not in (None, "state", "alloc", "all"):
            raise RuntimeError(
                f"expected enabled and context to be None, 'state', 'alloc' or 'all', got {enabled!r}, {context!r}"
            )
        if stacks not in ("python", "all"):
            raise RuntimeError(f"expected stacks to be 'python' or 'all', got {stacks!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise TypeError(f"max_entries must be a positive int, got {max_entries!r}")
        self.lazy_init()  # the C++ binding initialises CUDA first (at::globalContext().lazyInitDevice)
        if clear_history or enabled is None:
            for allocator in self.allocators:
                allocator.trace.clear()
        self.history = None if enabled is None else {"enabled": enabled, "context": context, "max_entries": max_entries}

    def snapshot(self, mempool_id) -> dict:
        """torch._C._cuda_memorySnapshot: segments and each device's recorded actions."""
        if mempool_id is not None and not isinstance(mempool_id, tuple):
            raise TypeError(f"_cuda_memorySnapshot(): expected None or a tuple, got {type(mempool_id).__name__}")
        segments = []
        for index, allocator in enumerate(self.allocators):
            blocks = [
                {"size": size, "address": address, "state": "active_allocated"}
                for address, size in allocator.blocks.items()
            ]
            if allocator.reserved:
                segment = {"device": index, "address": 0, "total_size": allocator.reserved, "stream": 0}
                segments.append(
                    segment | {"allocated_size": allocator.allocated, "segment_type": "large", "blocks": blocks}
                )
        return {"segments": segments, "device_traces": [list(allocator.trace) for allocator in self.allocators]}

    def attach_observer(self, observer) -> None:
        self.lazy_init()  # as the C++ binding does: observers attach to the devices' allocators, which need it
        if self.allocator_backend != "native":  # CUDAMallocAsyncAllocator.cpp says so
            raise RuntimeError(
                f"{self.allocator_backend} does not yet support attachOutOfMemoryObserver. "
                "If you need it, please file an issue describing your use case."
            )
        self.observers.append(observer)

    # -- cuBLAS -------------------------------------------------------------------------------

    def cublas_workspace_size(self) -> int:
        """What torch gives cuBLAS per (thread, stream) by default: 32 MiB on Hopper (sm90), else 8 MiB + 128 KiB."""
        return 4096 * 8 * 1024 if self.gpus[self.current].capability == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8

    def use_cublas(self, thread) -> None:
        """A GEMM on `thread`: its first one takes a workspace from the caching allocator, which stays allocated."""
        key = (thread, self.current)
        if self.initialized and key not in self.cublas_workspaces:
            self.cublas_workspaces[key] = self.allocate(self.cublas_workspace_size(), self.current)

    # -- streams -------------------------------------------------------------------------------

    def current_stream(self, index: int) -> tuple[int, int, int]:
        index = self._device(index, "_cuda_getCurrentStream")
        return self.current_streams[index], index, CUDA_DEVICE_TYPE

    def default_stream(self, index: int) -> tuple[int, int, int]:
        return 0, self._device(index, "_cuda_getDefaultStream"), CUDA_DEVICE_TYPE

    def set_stream(self, stream_id: int, device_index: int, device_type: int) -> None:
        # As in C++: the stream's device becomes the current device, and the stream its current stream.
        self.current = self._device(device_index, "_cuda_setStream")
        self.current_streams[device_index] = stream_id

    # -- installing ----------------------------------------------------------------------------

    def install(self, monkeypatch) -> FakeCuda:
        """Replace the layer under torch.cuda's Python functions with this fake, through `monkeypatch`."""
        monkeypatch.setattr(sys.modules[__name__], "_active", self)
        self._patch_functions(monkeypatch)
        self._patch_bindings(monkeypatch)
        monkeypatch.setattr(torch.cuda, "_get_device_properties", self.properties, raising=False)
        monkeypatch.setattr(
            torch.cuda,
            "_cudart",
            types.SimpleNamespace(cudaMemGetInfo=self._recorded("cudaMemGetInfo", self.mem_get_info)),
        )
        # torch.manual_seed seeds every CUDA generator once CUDA is initialised.
        monkeypatch.setattr(torch.cuda, "default_generators", tuple(torch.Generator() for _ in self.gpus))
        monkeypatch.setattr(torch.Tensor, "to", _to)
        monkeypatch.setattr(torch.Tensor, "pin_memory", _pin_memory)  # DataLoader(pin_memory=True) pins now
        monkeypatch.setattr(torch.Tensor, "is_pinned", _is_pinned)
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(self))
        monkeypatch.setattr(torch.nn.functional, "linear", _linear)
        self._reset_gpukit(monkeypatch)
        return self

    def _recorded(self, name: str, function):
        def call(*args, **kwargs):
            self._record(name, *args, *kwargs.values())
            return function(*args, **kwargs)

        return call

    def _patch_functions(self, monkeypatch) -> None:
        """torch.cuda's lowest Python functions, in every module of torch that imported them by name
        (torch.cuda.memory and torch.cuda.random hold their own references to _lazy_init and friends)."""
        replacements = {
            id(torch.cuda.is_available): self.is_available,
            id(torch.cuda.is_initialized): self.is_initialized,
            id(torch.cuda._lazy_init): self.lazy_init,
            id(torch.cuda.device_count): self.device_count,
            id(torch.cuda._exchange_device): self._recorded("_cuda_exchangeDevice", self.exchange_device),
            id(torch.cuda._maybe_exchange_device): self._recorded(
                "_cuda_maybeExchangeDevice", self.maybe_exchange_device
            ),
            id(torch.cuda.Stream): FakeStream,
            id(torch.cuda.Event): FakeEvent,
        }
        found = [
            (module, name, replacements[id(value)])
            for module_name, module in list(sys.modules.items())
            if module_name == "torch" or module_name.startswith("torch.")
            for name, value in list(getattr(module, "__dict__", {}).items())
            if id(value) in replacements
        ]
        for module, name, replacement in found:
            monkeypatch.setattr(module, name, replacement)

    def _patch_bindings(self, monkeypatch) -> None:
        bindings = {
            "_cuda_getDeviceCount": self.device_count,
            "_cuda_getDevice": lambda: self.current,
            "_cuda_setDevice": self.set_device,
            "_cuda_exchangeDevice": self.exchange_device,
            "_cuda_maybeExchangeDevice": self.maybe_exchange_device,
            "_cuda_synchronize": self.synchronize,
            "_cuda_memoryStats": self.memory_stats,
            "_cuda_resetPeakMemoryStats": self.reset_peak,
            "_cuda_emptyCache": self.empty_cache,
            "_cuda_setMemoryFraction": self.set_fraction,
            "_cuda_getMemoryFraction": self.get_fraction,
            "_cuda_record_memory_history": self.record_history,
            "_cuda_memorySnapshot": self.snapshot,
            "_cuda_attach_out_of_memory_observer": self.attach_observer,
            "_cuda_getAllocatorBackend": lambda: self.allocator_backend,
            "_cuda_getCurrentStream": self.current_stream,
            "_cuda_getDefaultStream": self.default_stream,
            # cuBLAS workspaces come from the caching allocator; their sizes are read from the environment
            "_cuda_getCublasWorkspaceSize": self.cublas_workspace_size,
            "_cuda_getCublasLtWorkspaceSize": lambda: 1024 * 1024,
            "_cuda_setStream": self.set_stream,
            # torch 2.14 has both; torch 2.11 only the setter (a test deletes the getter to run as on 2.11)
            "_accelerator_setAllocatorSettings": self.set_allocator_settings,
            "_accelerator_getAllocatorSettings": lambda: self.allocator_settings,
        }
        for name, function in bindings.items():
            monkeypatch.setattr(torch._C, name, self._recorded(name, function), raising=False)

    def _reset_gpukit(self, monkeypatch) -> None:
        """gpukit's own process-wide state about the GPU, fresh for the fake and restored after."""
        import gpukit.env
        from gpukit.memory import allocator

        monkeypatch.setattr(gpukit.env, "_surveys", {})  # detect() asks the fake NVML
        monkeypatch.setattr(allocator, "_watching", False)  # the observer attached to the fake goes with it
        monkeypatch.setattr(allocator, "_refused", {})
        monkeypatch.setattr(allocator, "_applied", None)  # the allocator settings it applied (torch 2.11 reads these)


# ---------------------------------------------------------------------------------------------
# Streams and events


def _check_stream(stream, what: str) -> FakeStream:
    if not isinstance(stream, FakeStream):
        raise TypeError(f"{what}(): argument 'stream' must be torch.cuda.Stream, not {type(stream).__name__}")
    return stream


class FakeStream:
    """torch.cuda.Stream on the fake: an id and a device; what is done with it goes to FakeCuda.calls."""

    def __init__(
        self,
        device=None,
        priority: int = 0,
        *,
        stream_id: int | None = None,
        device_index: int | None = None,
        device_type: int = CUDA_DEVICE_TYPE,
    ):
        fake = _fake()
        if stream_id is None:  # a new stream: torch.cuda.Stream(device) creates it under torch.cuda.device(device)
            with torch.cuda.device(device):
                device_index = fake.current
            fake.stream_count += 1
            stream_id = fake.stream_count
        self.stream_id, self.device_index, self.device_type, self.priority = (
            stream_id,
            device_index,
            device_type,
            priority,
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and (self.stream_id, self.device_index) == (
            other.stream_id,
            other.device_index,
        )

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index))

    def __repr__(self) -> str:
        return f"<FakeStream {self.stream_id} on cuda:{self.device_index}>"

    def wait_stream(self, stream) -> None:
        _fake()._record("wait_stream", self, _check_stream(stream, "wait_stream"))

    def wait_event(self, event) -> None:
        if not isinstance(event, FakeEvent):
            raise TypeError(f"wait_event(): argument 'event' must be torch.cuda.Event, not {type(event).__name__}")
        _fake()._record("wait_event", self, event)

    def record_event(self, event=None) -> FakeEvent:
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True  # the work was done on the host when it was issued

    def synchronize(self) -> None:
        fake = _fake()
        fake.completed[self.device_index] = fake.events


class FakeEvent:
    """torch.cuda.Event on the fake: its time is the host clock at record(); elapsed_time raises, as on a GPU,
    unless both events were created with enable_timing=True, recorded, and completed by a synchronisation."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ):
        self.enable_timing = enable_timing
        self.number: int | None = None  # the order in which events were recorded
        self.device_index = self.time = None

    def record(self, stream=None) -> None:
        stream = _check_stream(stream if stream is not None else torch.cuda.current_stream(), "record")
        fake = _fake()
        fake.events += 1
        self.number, self.device_index, self.time = fake.events, stream.device_index, time.perf_counter()
        fake._record("record_event", self, stream)

    def _completed(self) -> bool:
        return self.number is not None and self.number <= _fake().completed[self.device_index]

    def synchronize(self) -> None:
        if self.number is not None:
            fake = _fake()
            fake.completed[self.device_index] = max(fake.completed[self.device_index], self.number)

    def query(self) -> bool:
        self.synchronize()  # the work before it was done on the host when it was issued
        return True

    def wait(self, stream=None) -> None:
        stream = _check_stream(stream if stream is not None else torch.cuda.current_stream(), "wait")
        _fake()._record("wait_event", stream, self)

    def elapsed_time(self, end_event: FakeEvent) -> float:
        """Milliseconds between this event and `end_event` (host clock)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.number is None or end_event.number is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self._completed() and end_event._completed()):
            raise RuntimeError("CUDA error: device not ready")  # cudaEventElapsedTime before the events completed
        return (end_event.time - self.time) * 1e3


# ---------------------------------------------------------------------------------------------
# Tensors "on the GPU"


_real_linear = torch.nn.functional.linear


def _linear(inputs, weight, bias=None):
    """torch.nn.functional.linear under the fake: a cuBLAS GEMM on this thread, and in backward (the hook, called
    when the outputs' gradient arrives) GEMMs on autograd's device thread."""
    on_the_gpu = any(isinstance(tensor, FakeCudaTensor) for tensor in (inputs, weight, bias))
    if not on_the_gpu:  # operations on fake GPU tensors give CPU tensors: only a linear of one of them is "on" it
        return _real_linear(inputs, weight, bias)
    fake = _fake()
    fake.use_cublas(threading.get_ident())
    outputs = _real_linear(inputs, weight, bias)
    if outputs.requires_grad:
        outputs.register_hook(lambda grad: fake.use_cublas("autograd's device thread"))
    return outputs


class FakeCudaTensor(torch.Tensor):
    """What Tensor.to("cuda") returns under the fake: a CPU copy that says it is on cuda:N. Its bytes count as
    allocated on the fake GPU while it lives."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # operations on it give plain CPU tensors
    fake_index = 0

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.fake_index)

    def get_device(self) -> int:
        return self.fake_index

    def record_stream(self, stream) -> None:
        _fake()._record("record_stream", self, _check_stream(stream, "record_stream"))


_real_to = torch.Tensor.to


def _to(self, *args, **kwargs):
    """Tensor.to under the fake: to "cuda" (or a dtype while "on" it) gives a FakeCudaTensor; anything else is real."""
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
        *args, **{key: value for key, value in kwargs.items() if key != "copy"}
    )
    fake_source = isinstance(self, FakeCudaTensor)
    plain = torch.Tensor.as_subclass(self, torch.Tensor) if fake_source else self
    if device is None and fake_source:
        device = self.device  # a dtype or memory-format conversion on the device stays there
    if device is None or device.type != "cuda":
        return _real_to(plain, *args, **kwargs)
    fake = _fake()
    index = fake._device(device.index if device.index is not None else fake.current, "to")
    if fake_source and index == self.fake_index and dtype in (None, self.dtype) and not kwargs.get("copy"):
        return self  # already there: no copy, as on a GPU
    fake.lazy_init()
    data = _real_to(
        plain, "cpu", dtype=dtype or plain.dtype, copy=True, memory_format=memory_format or torch.preserve_format
    )
    address = fake.allocate(data.untyped_storage().nbytes(), index)
    copy = data.as_subclass(FakeCudaTensor)
    copy.fake_index = index
    weakref.finalize(copy, fake.free, address, index).atexit = False
    fake.copies.append(
        {
            "shape": tuple(data.shape),
            "dtype": data.dtype,
            "device": index,
            "non_blocking": non_blocking,
            "pinned": _is_pinned(self),
            "stream": fake.current_streams[index],
            "from_device": fake_source,
        }
    )
    return copy


def _pin_memory(self, device=None):
    """Tensor.pin_memory under the fake: a copy in ordinary host memory that says it is page-locked."""
    _fake()._record("pin_memory", tuple(self.shape))
    pinned = self.clone()
    pinned.fake_pinned = True
    return pinned


def _is_pinned(self, device=None) -> bool:
    return getattr(self, "fake_pinned", False)


# ---------------------------------------------------------------------------------------------
# NVML


class FakeNVMLError(Exception):
    pass


@dataclass(frozen=True)
class _NVMLHandle:
    index: int


class _NVML:
    """What the fake pynvml answers about the fake GPUs. As in NVML, every query before nvmlInit (or after the
    matching nvmlShutdown) raises Uninitialized, and one about a GPU needs a handle from nvmlDeviceGetHandleByIndex."""

    def __init__(self, fake: FakeCuda):
        self.fake, self.started = fake, time.perf_counter()

    def system(self, answer):
        def ask(*args):
            if self.fake.nvml_initialized == 0:
                raise FakeNVMLError("Uninitialized")
            return answer(*args)

        return ask

    def device(self, answer):
        """A query about one GPU: checks the handle, then answers with that GPU's index."""

        def ask(handle, *args):
            if not isinstance(handle, _NVMLHandle):
                raise FakeNVMLError("Invalid Argument")
            return self.system(answer)(handle.index, *args)

        return ask

    def handle_by_index(self, index: int) -> _NVMLHandle:
        if not 0 <= index < len(self.fake.gpus):
            raise FakeNVMLError("Invalid Argument")
        return _NVMLHandle(index)

    def used(self, index: int) -> int:
        """Bytes this process holds on the GPU: its CUDA context, once it has one, and the allocator's cache."""
        return (CONTEXT_BYTES if index in self.fake.contexts else 0) + self.fake.allocators[index].reserved

    def memory(self, index: int) -> types.SimpleNamespace:
        total = self.fake.gpus[index].total_memory
        return types.SimpleNamespace(total=total, used=self.used(index), free=total - self.used(index))

    def processes(self, index: int) -> list:
        own = types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.used(index))
        return [own] if index in self.fake.contexts else []

    def energy(self, index: int) -> int:
        """mJ since the driver loaded: the GPU's power_w over the host clock."""
        return int(1e9 + (time.perf_counter() - self.started) * self.fake.gpus[index].power_w * 1000)


def fake_pynvml(fake: FakeCuda) -> types.ModuleType:
    """A `pynvml` module that sees the fake GPUs, each drawing its power_w at full clocks."""
    nvml, gpus = _NVML(fake), fake.gpus
    system, device = nvml.system, nvml.device
    module = types.ModuleType("pynvml")
    module.__dict__.update(
        NVMLError=FakeNVMLError,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlInit=lambda: setattr(fake, "nvml_initialized", fake.nvml_initialized + 1),
        nvmlShutdown=system(lambda: setattr(fake, "nvml_initialized", fake.nvml_initialized - 1)),
        nvmlSystemGetDriverVersion=system(lambda: "580.159"),
        nvmlSystemGetCudaDriverVersion=system(lambda: 13000),  # CUDA 13.0
        nvmlSystemGetProcessName=system(lambda pid: "python"),
        nvmlDeviceGetCount=system(lambda: len(gpus)),
        nvmlDeviceGetHandleByIndex=system(nvml.handle_by_index),
        nvmlDeviceGetName=device(lambda index: gpus[index].name),
        nvmlDeviceGetCudaComputeCapability=device(lambda index: gpus[index].capability),
        nvmlDeviceGetMemoryInfo=device(nvml.memory),
        nvmlDeviceGetUtilizationRates=device(lambda index: types.SimpleNamespace(gpu=87, memory=40)),  # %
        nvmlDeviceGetPowerUsage=device(lambda index: int(gpus[index].power_w * 1000)),  # mW
        nvmlDeviceGetTotalEnergyConsumption=device(nvml.energy),
        nvmlDeviceGetEnforcedPowerLimit=device(lambda index: 700_000),  # mW
        nvmlDeviceGetPowerManagementDefaultLimit=device(lambda index: 700_000),
        nvmlDeviceGetTemperature=device(lambda index, sensor: 45),  # °C
        nvmlDeviceGetClockInfo=device(lambda index, clock: {1: 1980, 2: 2619}[clock]),  # MHz, by NVML_CLOCK_*
        nvmlDeviceGetCurrentClocksEventReasons=device(lambda index: 0),  # no reason: full clocks
        nvmlDeviceGetComputeRunningProcesses=device(nvml.processes),
        nvmlDeviceGetPersistenceMode=device(lambda index: 1),
        nvmlDeviceGetTotalEccErrors=device(lambda index, error_type, counter: 0),
    )
    return module
