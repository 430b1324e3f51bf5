"""Counting tensor bytes: storages alive operator by operator, and bytes saved for backward.

Every byte count is of tensor storages, each storage counted once however many views use it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CUDA_BLOCK = 512  # bytes: the CUDA caching allocator rounds every allocation up to a multiple of this
CUDA_UNSPLIT = 2**20  # bytes: it hands out a large cached block whole when no more than this would remain


def allocator_slack_for(storage_sizes) -> int:
    """The most the CUDA caching allocator's `memory_allocated` can count beyond live tensors of these sizes (bytes).

    From torch's c10/cuda/CUDACachingAllocator.cpp with its default settings (no PYTORCH_CUDA_ALLOC_CONF): every
    request is rounded up to a 512-byte block (CUDA_BLOCK; LiveTensors(rounding=CUDA_BLOCK) counts that already). A
    request of 1 MiB or less is cut exactly from a 2 MiB segment of the small pool: nothing more. A larger one gets a
    block of the large pool, handed out whole when 1 MiB or less of it would remain: up to 1 MiB more per storage over
    1 MiB. The segments themselves (2 MiB, 20 MiB, multiples of 2 MiB) count as reserved, not allocated. Memory that
    is no tensor's (cuBLAS's workspaces, cuDNN's inside an operator) is not in this bound.
    """
    return sum(CUDA_UNSPLIT for size in storage_sizes if -(-size // CUDA_BLOCK) * CUDA_BLOCK > CUDA_UNSPLIT)


def keeps_generators(function: Callable) -> Callable:
    """`function` with torch's random generators as they were when it returns (or raises): the CPU's, and every
    initialised CUDA device's. The model runs that gk.memory makes draw (dropout, a diffusion model's noise): a run
    seeded before estimate() must draw after it what it would have drawn without it."""

    @functools.wraps(function)
    def kept(*args, **kwargs):
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            return function(*args, **kwargs)

    return kept


def storage_of(tensor) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (nested, some subclasses)
        return None


def dense_parts(tensor) -> tuple:
    """The tensors that hold `tensor`'s bytes: a sparse COO tensor's indices (int64, (dims, nnz)) and values (nnz
    rows: an nn.Embedding(sparse=True)'s gradient), else the tensor itself."""
    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    return (tensor,)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a sparse tensor's: its indices' and values')."""
    sizes = {}
    for part in (part for tensor in tensors for part in dense_parts(tensor)):
        storage = storage_of(part)
        if storage is not None:
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


class LiveTensors(TorchDispatchMode):
    """Bytes of tensor storages alive, updated after every operator.

    A new storage is counted when an operator first returns it (views share their base's
    storage) and uncounted when it is freed (a weak reference's callback). Storages that
    existed before are counted only if passed to `add`. `phase` labels the samples. Each storage gets a
    serial number when first counted (an address can be reused by a later storage, a serial cannot);
    `at_peak` maps the serials of the storages alive at the peak to their bytes, so that the peak can be
    told apart into what was alive then.
    `allocated`, a function returning the allocator's count in bytes (CUDA), is read at every
    sample too, into `allocator_samples`, so that the two counts can be compared op by op.
    """

    def __init__(self, device_type: str, rounding: int = 1, allocated: Callable[[], int] | None = None):
        super().__init__()
        self.device_type = device_type
        self.rounding = rounding
        self.allocated = allocated
        self.allocator_samples: list[int] = []  # the allocator's bytes after each operator (with `allocated`)
        self.most_storages = 0  # the most storages alive at once
        self.large_storages = 0  # storages over CUDA_UNSPLIT bytes alive now, and the most at once: the allocator
        self.most_large_storages = 0  # may count up to CUDA_UNSPLIT more for each (allocator_slack_for)
        self.live: dict[int, tuple[weakref.ref, int, int]] = {}  # storage id -> (weak reference, bytes, serial)
        self.counted = 0  # storages counted so far: the next one's serial
        self.at_peak: dict[int, int] = {}  # serial -> bytes, of the storages alive at the peak
        self.bytes = 0
        self.peak = 0
        self.peak_phase = "start"
        self.phase = "start"
        self.samples: list[int] = []  # bytes alive after each operator
        self.phase_starts: list[tuple[str, int]] = []  # (phase, index of its first sample)

    def add(self, tensors) -> None:
        for tensor in tensors:
            for part in dense_parts(tensor):
                self._count(part)
        self._sample()

    def serial_of(self, tensor) -> int | None:
        """The serial of the live storage behind `tensor` (None if it is not counted)."""
        storage = storage_of(tensor)
        known = self.live.get(storage._cdata) if storage is not None else None
        return known[2] if known is not None else None

    def start_phase(self, name: str) -> None:
        self.phase = name
        self.phase_starts.append((name, len(self.samples)))

    def _count(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        storage = storage_of(tensor)
        if storage is None:
            return
        key = storage._cdata
        size = -(-storage.nbytes() // self.rounding) * self.rounding
        known = self.live.get(key)
        if known is not None:  # in place, or a view; an out= argument may have been resized
            self.bytes += size - known[1]
            self.large_storages += (size > CUDA_UNSPLIT) - (known[1] > CUDA_UNSPLIT)
            self.live[key] = (known[0], size, known[2])
            return
        self.bytes += size
        self.large_storages += size > CUDA_UNSPLIT
        self.live[key] = (weakref.ref(storage, partial(self._freed, key)), size, self.counted)
        self.counted += 1

    def _freed(self, key: int, _reference) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
            self.large_storages -= entry[1] > CUDA_UNSPLIT

    def _sample(self) -> None:
        self.samples.append(self.bytes)
        self.most_storages = max(self.most_storages, len(self.live))
        self.most_large_storages = max(self.most_large_storages, self.large_storages)
        if self.allocated is not None:
            self.allocator_samples.append(self.allocated())
        if self.bytes > self.peak:
            self.peak, self.peak_phase = self.bytes, self.phase
            self.at_peak = {serial: size for _, size, serial in self.live.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place result) allocated nothing.
        leaves = [part for leaf in tree_leaves((args, kwargs)) for part in dense_parts(leaf)]
        inputs = {storage._cdata for storage in map(storage_of, leaves) if storage is not None}
        for tensor in (part for leaf in tree_leaves(out) for part in dense_parts(leaf)):
            storage = storage_of(tensor)
            if storage is not None and (storage._cdata not in inputs or storage._cdata in self.live):
                self._count(tensor)
        self._sample()
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self.live.clear()  # drops the weak references: no callbacks after the measurement
        self.large_storages = 0
        return result


def _is_cast_parameter(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or the tensor it is a view of: a Linear saves its weight transposed) is a parameter
    cast to another dtype: made by `_to_copy` of a leaf that autograd accumulates a gradient into."""
    base = tensor._base if tensor._base is not None else tensor
    node = base.grad_fn
    if node is None or node.name() != "ToCopyBackward0":
        return False
    return any(isinstance(getattr(source, "variable", None), nn.Parameter) for source, _ in node.next_functions)


class SavedTensors:
    """Bytes that autograd saves for backward, from saved-tensor hooks, per module.

    Each storage counts once; parameters and buffers (the `exclude` storages) are not
    activations and are left out. Inside a non-reentrant checkpoint region only the region's
    inputs are saved, so a checkpointed model is counted as it really is. Only storages still
    alive when the forward ends count (saved by a graph that was dropped, they are not kept for
    backward): a freed storage's address can be reused by a new one, which must count afresh.

    `weight_copies`: the bytes of those storages that are a parameter cast to another dtype (autocast's
    bf16 or fp16 copy of an fp32 weight, which the convolution or matrix product that used it saves).
    `serials`: the tracker's serials of the storages counted (with a `tracker`), to find them at its peak.
    """

    def __init__(self, model: nn.Module, exclude: set[int], tracker: LiveTensors | None = None):
        self.model = model
        self.exclude = exclude
        self.tracker = tracker
        # storage id -> (weak reference, bytes, module, whether it is a cast copy of a parameter)
        self.saved: dict[int, tuple[weakref.ref, int, str, bool]] = {}
        self.bytes = 0
        self.weight_copies = 0
        self.weight_copy_dtypes: set[torch.dtype] = set()
        self.serials: set[int] = set()
        self.by_module: Counter = Counter()
        self.stack: list[str] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = storage_of(tensor)
        if storage is not None and storage._cdata not in self.exclude:
            known = self.saved.get(storage._cdata)
            if known is None or known[0]() is None:  # new, or a freed storage's address reused
                module = self.stack[-1] if self.stack else "(outside modules)"
                copy = _is_cast_parameter(tensor)
                if copy:
                    self.weight_copy_dtypes.add(tensor.dtype)
                self.saved[storage._cdata] = (weakref.ref(storage), storage.nbytes(), module, copy)
        return tensor

    def _count_alive(self) -> None:
        for reference, size, module, copy in self.saved.values():
            storage = reference()
            if storage is not None:
                self.bytes += size
                self.weight_copies += size if copy else 0
                self.by_module[module] += size
                serial = self.tracker.live.get(storage._cdata) if self.tracker is not None else None
                if serial is not None:
                    self.serials.add(serial[2])
        self.saved.clear()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        def enter(name: str) -> Callable:
            def hook(*_) -> None:  # a hook that returns something would replace the module's input
                self.stack.append(name or "(model)")

            return hook

        def leave(*_) -> None:
            if self.stack:
                self.stack.pop()

        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._count_alive()
