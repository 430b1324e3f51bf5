"""Scratch memory each layer takes inside its operators on a CUDA GPU (library workspaces), measured alone.

A breakdown on CUDA reports `workspace`: the step's peak minus the allocator's highest count after any
operator, i.e. memory that lives only inside one operator call. Most of it is cuDNN's: for each convolution
cuDNN picks an algorithm (an "engine") from the shapes, the dtype and the flags (TF32 allowed or not,
deterministic, benchmark), the algorithm states how much scratch memory it needs, and PyTorch takes that from
its caching allocator for the call and frees it before the call returns. So it counts in
torch.cuda.max_memory_allocated but in no tensor, and a prediction from tensors cannot include it.
layer_workspaces() measures it layer by layer, each layer alone, to show which layers need it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..env import resolve_device
from ..precision import Precision, get_precision
from .counting import keeps_generators
from .measured_step import check_model, compact, sample_batch


class OperatorScratch(TorchDispatchMode):
    """The most bytes any operator run inside held on a CUDA device beyond what was allocated when it returned.

    The allocator's peak is restarted before every operator, so its peak after the operator is the operator's
    own: its inputs, its outputs and its scratch space. This resets the device's peak statistics.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.most = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.reset_peak_memory_stats(self.device)  # the peak restarts at what is allocated now
        out = func(*args, **(kwargs or {}))
        held = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        self.most = max(self.most, held)
        return out


@dataclass(frozen=True)
class _TensorSpec:
    """What a layer's input looked like: enough to make one like it (values do not change memory)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def make(self, device: torch.device) -> torch.Tensor:
        # Made on the host and copied, as a loader's batch is; .to keeps the layout (e.g. channels_last).
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype).zero_().to(device)
        if not self.requires_grad:
            return tensor
        # An input that needs a gradient came out of an earlier layer: not a leaf, so that an in-place layer
        # (ReLU(inplace=True)) may write to it, which autograd refuses on a leaf.
        return tensor.requires_grad_().clone()


def _spec(value):
    if not isinstance(value, torch.Tensor):
        return value
    return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)


def _layer_calls(model: nn.Module, inputs, precision: Precision) -> list[tuple[str, nn.Module, tuple]]:
    """Every call of a leaf module in one forward pass: (name, module, (args, kwargs) as specs)."""
    calls = []

    def recorder(name: str):
        def record(module, args, kwargs) -> None:  # returns nothing: the inputs stay as they are
            calls.append((name, module, tree_map(_spec, (args, kwargs))))

        return record

    leaves = [(name, module) for name, module in model.named_modules() if next(module.children(), None) is None]
    handles = [module.register_forward_pre_hook(recorder(name), with_kwargs=True) for name, module in leaves]
    try:
        with precision.flags(), precision.autocast():
            inputs.call(model)  # outputs and their graph are dropped at once
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _layer_scratch(module: nn.Module, specs: tuple, precision: Precision, device: torch.device) -> int:
    """The most scratch any operator of one layer held, in its forward and (where it has one) backward."""
    args, kwargs = tree_map(
        lambda value: value.make(device) if isinstance(value, _TensorSpec) else value,
        specs,
        is_leaf=lambda value: isinstance(value, _TensorSpec),
    )
    scratch = OperatorScratch(device)
    with precision.flags():
        with scratch, precision.autocast():
            outputs = module(*args, **kwargs)
        outputs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        gradients = [torch.ones_like(t) for t in outputs]  # made outside the measurement
        if outputs:
            with scratch:
                torch.autograd.backward(outputs, gradients)
    return scratch.most


@keeps_generators
def layer_workspaces(
    model: nn.Module,
    batch,
    *,
    precision: str | Precision = "fp32",
    device: str | torch.device | None = "cuda",
) -> dict[str, int]:
    """Bytes each layer holds on a CUDA GPU inside one operator beyond what the operator returns: its
    library workspaces (cuDNN's for convolutions), measured for each layer alone, forward and backward.

    `batch` is an example batch of any form fit accepts (only its inputs are used). One forward pass of
    a copy of `model` records what every leaf module receives; then each leaf runs alone on inputs of
    that shape, dtype and layout, under the precision's flags and autocast (cuDNN's choice of algorithm
    depends on them: in strict fp32, with TF32 off, it often picks algorithms with large workspaces).
    Returns {module name: bytes}, in the order the layers ran. Your model is not changed. This resets
    the GPU's peak memory statistics.

    A breakdown's `workspace` on the same batch is at most the largest of these, up to the allocator's
    rounding, when the step's scratch memory comes from its layers.
    """
    check_model(model)
    device = resolve_device(device)
    if device.type != "cuda":
        raise ValueError(
            f"layer_workspaces reads the CUDA caching allocator's statistics, and {device} is not a CUDA device; "
            "elsewhere memory inside an operator is not measured (gk.memory.breakdown tracks tensors only)."
        )
    precision = get_precision(precision, device)
    inputs = compact(sample_batch(model, batch), device)
    copied = copy.deepcopy(model).to(device).train()
    workspaces: dict[str, int] = {}
    for name, module, specs in _layer_calls(copied, inputs, precision):
        workspaces[name] = max(workspaces.get(name, 0), _layer_scratch(module, specs, precision, device))
    return workspaces
