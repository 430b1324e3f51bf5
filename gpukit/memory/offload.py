"""Activation offloading: what the forward saves for backward waits in host memory instead of the GPU's.

torch.autograd.graph.save_on_cpu copies each tensor autograd saves to (pinned) host memory as the forward
runs, and back to the GPU when the backward needs it. The GPU then holds little more than one layer's
activations at a time (as with activation checkpointing, but nothing is recomputed); the price is
moving the saved bytes twice over PCIe each step. save_on_cpu copies synchronously, so the step grows by
about 2 × saved bytes / PCIe bandwidth: `offload_cost` computes it from a measured breakdown.
Frameworks that overlap the copies with compute on a side stream (torchtune, torchtitan's
MUST_CPU_OFFLOAD policy) hide part of it. On a CPU the activations are in host memory already: there is
nothing to offload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["OffloadActivations", "OffloadCost", "offload_cost"]

PCIE_BYTES_PER_SECOND = {  # one direction, x16, as measured copies reach (about 80% of the link's rate)
    "PCIe 3.0": 12e9,
    "PCIe 4.0": 25e9,
    "PCIe 5.0": 50e9,
}


class OffloadActivations(nn.Module):
    """`module` whose forward keeps what it saves for backward in host memory (pinned where a CUDA GPU is).

    The saved tensors' hooks are attached as the forward runs, so the backward, called outside this
    wrapper, still brings them back. Parameters and buffers are those of `module` (its state_dict keys
    start with "module.").
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        if not callable(module):
            raise TypeError(f"expected a module (or a callable model) to wrap, got {type(module).__name__}.")
        self.module = module

    def forward(self, *args, **kwargs):
        # Pinned host memory makes the copies fast, and needs a CUDA driver; CPU tensors are saved as they are.
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return self.module(*args, **kwargs)


@dataclass
class OffloadCost:
    """What offloading a step's saved activations costs at a PCIe bandwidth."""

    saved_bytes: int  # saved for backward per step (gk.memory.breakdown's activations)
    step_seconds: float  # a step without offloading
    bandwidth: float  # bytes/s one way

    @property
    def bandwidth_to_hide(self) -> float:
        """Bytes/s that would move the saved bytes out and back within one step: what full overlap needs."""
        return 2 * self.saved_bytes / self.step_seconds

    @property
    def added_seconds(self) -> float:
        """Seconds save_on_cpu's synchronous copies add to a step at this bandwidth."""
        return 2 * self.saved_bytes / self.bandwidth

    def __str__(self) -> str:
        return (
            f"{self.saved_bytes / 2**20:,.1f} MiB saved per step, a step of {self.step_seconds * 1e3:,.1f} ms: "
            f"hiding the copies needs {self.bandwidth_to_hide / 1e9:,.2f} GB/s each way; at {self.bandwidth / 1e9:g} "
            f"GB/s synchronous copies add {self.added_seconds * 1e3:,.1f} ms "
            f"(+{100 * self.added_seconds / self.step_seconds:.0f}%)"
        )


def offload_cost(saved_bytes: int, step_seconds: float, bandwidth: float = PCIE_BYTES_PER_SECOND["PCIe 4.0"]):
    """The PCIe traffic that offloading `saved_bytes` per step of `step_seconds` needs, and what it adds."""
    if saved_bytes < 0 or not step_seconds > 0 or not bandwidth > 0:
        raise ValueError(
            f"need saved_bytes >= 0, step_seconds > 0 and bandwidth > 0 (bytes/s), got {saved_bytes!r}, "
            f"{step_seconds!r} and {bandwidth!r}."
        )
    return OffloadCost(int(saved_bytes), float(step_seconds), float(bandwidth))
