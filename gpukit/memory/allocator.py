"""The CUDA caching allocator, and what to do when it runs out.

TrainingOutOfMemoryError, out_of_memory_error()  what fit() raises on an out-of-memory error:
                   the phase, the bytes asked for and free, what to try.
free_memory()      collect unreachable tensors and return cached CUDA blocks.
limit_gpu_memory() a smaller GPU on a big one (set_per_process_memory_fraction), for lessons.
expandable_segments()  the allocator setting that reduces fragmentation, for one block.
record_snapshot()  every allocation and free of a block, for plots and https://pytorch.org/memory_viz.

gpukit.memory re-exports all of these.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..env import cuda_index
from ..report import format_bytes

# ---------------------------------------------------------------------------------------------
# Out-of-memory help for fit()


class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """fit() ran out of device memory.

    The message says in which phase (loading data, forward, backward, optimizer step,
    evaluation), how much memory was asked for and free, and what to try. fit() freed what it
    held before raising this, so the notebook kernel keeps working. It is a
    torch.OutOfMemoryError, so `except torch.OutOfMemoryError` catches it.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str = "",
        device: str = "",
        requested: int | None = None,
        free: int | None = None,
        total: int | None = None,
        allocated: int | None = None,
        reserved: int | None = None,
    ):
        super().__init__(message)
        self.phase, self.device = phase, device
        self.requested, self.free, self.total = requested, free, total  # bytes, None where unknown
        self.allocated, self.reserved = allocated, reserved


_refused: dict[str, int] = {}  # the last allocation the CUDA allocator refused
_watching = False


def _record_refusal(device: int, requested: int, limit: int, free: int) -> None:
    _refused.update(device=device, requested=requested)  # bytes of the allocation that failed


def watch_out_of_memory() -> None:
    """Have the CUDA allocator report the size of any allocation it refuses, for fit's message.

    Attaches an observer once per process (PyTorch offers no way to detach it); it only
    records four numbers when an allocation fails, and costs nothing otherwise. Allocators
    without observers (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, a pluggable one) refuse
    it: the message then leaves out the size asked for.
    """
    global _watching
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if not _watching and attach is not None:
        try:
            attach(_record_refusal)
        except RuntimeError:  # "cudaMallocAsync does not yet support attachOutOfMemoryObserver"
            pass
        _watching = True


_WHERE = {
    "forward": "in the forward pass",
    "backward": "in the backward pass",
    "optimizer step": "in the optimizer step",
    "loading data": "while loading a batch",
    "evaluation": "in evaluation",
}
_ADVICE = {
    "forward": "the forward pass keeps activations for backward, which grow with the batch",
    "backward": "the backward pass holds the saved activations and the new gradients, which grow with the batch",
    "optimizer step": "the optimizer step holds parameters, gradients and the optimizer's state; the batch does not matter here",
    "loading data": "loading the batch failed: the dataset or the batch on the device does not fit",
    "evaluation": "evaluation ran out of memory: its batch (512 by default) is larger than the training batch",
}


def _fixes(phase: str, batch_size: int, accumulate: int) -> str:
    if phase == "optimizer step":
        return (
            "try optimizer='nesterov' (one state tensor per parameter, AdamW keeps two), a smaller model, or "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True if reserved is far above allocated"
        )
    if phase == "loading data":
        return "keep the dataset on the CPU (gk.data.dataloader) or train on a subset"
    if phase == "evaluation":
        return "leave eval_data out of fit and call gk.evaluate(model, data, batch_size=...) with a smaller batch"
    smaller = batch_size // 2
    batch = (
        f"a smaller batch with the same global batch (batch_size={smaller}, accumulate={accumulate * 2}; "
        "gk.memory.max_batch_size finds the largest that fits), "
        if smaller >= 1
        else ""
    )
    return (
        f"try {batch}precision='bf16-mixed' (about half the activations), "
        "activation checkpointing (gk.memory.apply_activation_checkpointing(model)), or "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True if reserved is far above allocated (fragmentation)"
    )


def out_of_memory_error(
    error: BaseException,
    phase: str,
    device: torch.device,
    *,
    batch_size: int,
    accumulate: int = 1,
    precision: str = "fp32",
) -> TrainingOutOfMemoryError:
    """The error fit() raises for `error` (a torch.OutOfMemoryError) in `phase`.

    Reads the numbers it reports now, while the failed step's tensors are still alive; it
    keeps no reference to `error` (whose traceback holds them) so that they can be freed.
    """
    facts = {"phase": phase, "device": str(device)}
    if device.type == "cuda":
        refused = dict(_refused)
        _refused.clear()
        index = cuda_index(device)  # fit passes torch.device("cuda"), which the memory-fraction functions refuse
        free, total = torch.cuda.mem_get_info(index)
        reserved = torch.cuda.memory_reserved(index)
        fraction = torch.cuda.get_per_process_memory_fraction(index)
        where = "on the GPU"
        if fraction < 1:  # under a cap (limit_gpu_memory), the room left is the cap's, not the device's
            total = int(fraction * torch.cuda.get_device_properties(index).total_memory)
            free, where = min(max(total - reserved, 0), free), "under this process's memory cap"
        facts |= {
            "free": free,
            "total": total,
            "requested": refused.get("requested"),
            "allocated": torch.cuda.memory_allocated(index),
            "reserved": reserved,
        }
        asked = f"asked for {format_bytes(facts['requested'])}" if facts["requested"] is not None else "asked for more"
        numbers = (
            f"it {asked} while {format_bytes(free)} of {format_bytes(total)} was free {where}; PyTorch had "
            f"{format_bytes(facts['allocated'])} allocated and {format_bytes(reserved)} reserved"
        )
    else:
        numbers = "how much it asked for is not reported outside the CUDA allocator"
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    message = (
        f"out of memory on {device} {_WHERE.get(phase, phase)} (batch {batch_size}"
        f"{f' × accumulate {accumulate}' if accumulate > 1 else ''}, precision {precision}): {numbers}. "
        f"{_ADVICE.get(phase, phase).capitalize()}: {_fixes(phase, batch_size, accumulate)}. fit released the memory it "
        f"held, so this kernel can go on. (PyTorch said: {first_line})"
    )
    return TrainingOutOfMemoryError(message, **facts)


def free_memory(device: str | torch.device | None = None) -> None:
    """Collect unreachable tensors and, on CUDA, return cached blocks to the driver.

    Call it after deleting references (`del model, optimizer`), e.g. after an OOM; memory
    still referenced (by a variable, or a stored exception's traceback) cannot be freed.
    """
    gc.collect()
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# CUDA allocator tools for lessons


def _cuda_device(device, what: str) -> torch.device:
    """`device` (default "cuda") with its index: torch's memory-fraction functions refuse one without."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"{what} works on a CUDA GPU, and {'this machine has none' if not torch.cuda.is_available() else f'{device} is not one'}; "
            "without a GPU, plan against a budget instead: gk.memory.max_batch_size(..., budget=bytes, device='cuda')."
        )
    return torch.device("cuda", cuda_index(device))


@contextlib.contextmanager
def limit_gpu_memory(budget: int | float, device: str | torch.device | None = None) -> Iterator[int]:
    """Cap this process's CUDA memory to `budget` bytes (an int) or a fraction of the GPU (a float).

    Acts like a smaller GPU, so a lesson can provoke a real out-of-memory error on any GPU.
    Memory this process already holds counts against the cap. Yields the cap in bytes; the
    previous cap is restored afterwards (torch.cuda.set_per_process_memory_fraction).
    """
    device = _cuda_device(device, "limit_gpu_memory")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = budget if isinstance(budget, float) else budget / total
    if not 0 < fraction <= 1:
        raise ValueError(
            f"budget must be a positive size up to the GPU's {format_bytes(total)} (or a fraction in (0, 1]), got {budget!r}."
        )
    previous = torch.cuda.get_per_process_memory_fraction(device)
    free_memory(device)  # cached blocks beyond the cap would otherwise stay usable
    torch.cuda.set_per_process_memory_fraction(float(fraction), device)
    try:
        yield int(fraction * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)
        free_memory(device)


# Where torch reads its allocator settings at start-up, in the order it tries them (c10's AllocatorConfig, torch
# 2.11 to 2.14); PYTORCH_ALLOC_CONF is the new name, the others are kept for compatibility.
_ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_applied: str | None = None  # the settings expandable_segments() applied last: torch 2.11 cannot read them back


def allocator_settings() -> str:
    """The allocator settings torch applied last, as a string like "max_split_size_mb:128,expandable_segments:True".

    Recent torch (2.14) reads them back (torch._C._accelerator_getAllocatorSettings); torch 2.11 has no
    getter, so there they are what expandable_segments() applied last, else the environment variable torch
    read at start-up. Settings applied with torch's own setter are then not seen.
    """
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return getter()
    if _applied is not None:
        return _applied
    return next((os.environ[name] for name in _ALLOCATOR_VARIABLES if name in os.environ), "")


def _expandable_in(settings: str) -> bool:
    # The last value wins, as torch parses left to right; absent means off (torch's default).
    values = re.findall(r"expandable_segments\s*:\s*(\w+)", settings)
    return bool(values) and values[-1] == "True"


def _expandable_now() -> bool:
    return _expandable_in(allocator_settings())


def _apply(settings: str, enabled: bool) -> None:
    """Apply `settings` with expandable segments `enabled`. Each call resets the options it does not name
    (max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions) to torch's defaults, so the
    previous settings are applied again with the new value last."""
    global _applied
    others = re.sub(r"expandable_segments\s*:\s*\w+", "", settings)
    settings = ",".join([*(part for part in others.split(",") if part.strip()), f"expandable_segments:{enabled}"])
    torch._C._accelerator_setAllocatorSettings(settings)  # torch 2.11 to 2.14 (torch.cuda's wrapper is deprecated)
    _applied = settings


@contextlib.contextmanager
def expandable_segments(enabled: bool = True) -> Iterator[None]:
    """Switch the CUDA allocator's expandable segments on (or off) inside the block, then restore.

    With expandable segments the allocator grows one mapping instead of reserving fixed-size
    segments, so memory freed in one shape can be reused by another: less fragmentation, the
    gap between reserved and allocated shrinks. The same as PYTORCH_ALLOC_CONF=
    expandable_segments:True for this block; the other allocator settings are kept, and cached
    memory is released on entry and exit.
    """
    _cuda_device(None, "expandable_segments")
    previous_settings = allocator_settings()
    previous = _expandable_in(previous_settings)
    free_memory("cuda")
    _apply(previous_settings, enabled)
    try:
        yield
    finally:
        free_memory("cuda")
        _apply(previous_settings, previous)


@dataclass
class Snapshot:
    """A CUDA memory snapshot (torch.cuda.memory._snapshot) and what was allocated before it began."""

    data: dict = field(default_factory=dict, repr=False)
    device: int = 0
    baseline: int = 0  # bytes allocated when recording started

    def dump(self, path: str | Path) -> Path:
        """Write the snapshot for the viewer at https://pytorch.org/memory_viz (drag the file there)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            pickle.dump(self.data, file)
        return path

    def timeline(self) -> list[int]:
        """Bytes allocated after each allocation or free the snapshot recorded."""
        allocated, timeline = self.baseline, []
        for event in self.data.get("device_traces", [[]])[self.device]:
            if event["action"] == "alloc":
                allocated += event["size"]
            elif event["action"] == "free_completed":
                allocated -= event["size"]
            else:
                continue
            timeline.append(allocated)
        return timeline


@contextlib.contextmanager
def record_snapshot(device: str | torch.device | None = None, max_entries: int = 100_000) -> Iterator[Snapshot]:
    """Record every CUDA allocation and free inside the block (with Python stacks) into a Snapshot.

    torch.cuda.memory._record_memory_history is switched on for the block and off after it.
    Draw it with gk.memory.plot_memory_timeline(snapshot), or dump it for https://pytorch.org/memory_viz.
    """
    device = _cuda_device(device, "record_snapshot")
    snapshot = Snapshot(device=device.index, baseline=torch.cuda.memory_allocated(device))
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", device=device)
    try:
        yield snapshot
    finally:
        snapshot.data = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
