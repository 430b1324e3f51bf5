"""A region of a model recomputed in backward: what activation checkpointing wraps around a block's forward.

`_Region` runs its modules under torch.utils.checkpoint (use_reentrant=False): the forward keeps only the region's
inputs, and backward runs the forward again to get back the activations it needs. policy="selective" keeps the
outputs of SAVED_OPERATORS (matmuls, convolutions, attention) and recomputes the rest (`selective_policy`). A
region's buffers are copied before its forward, so that the recomputation sees what the forward saw and the step
ends with the buffers as the forward left them (`_BuffersOfOneCall`). `_Sequence` runs an nn.Sequential whose
consecutive children form regions. apply_activation_checkpointing (activation_checkpointing.py) puts them in place.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# What policy="selective" keeps: the outputs of operators whose recomputation costs FLOPs (matrix products,
# convolutions, attention kernels of every backend, FP8 matmuls); everything else is recomputed in backward.
SAVED_OPERATORS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def _saved_overloads() -> frozenset:
    """The operator overloads of SAVED_OPERATORS that this torch has."""
    packets = (getattr(torch.ops.aten, name, None) for name in SAVED_OPERATORS)
    return frozenset(getattr(packet, overload) for packet in packets if packet is not None for overload in packet)


def selective_policy(context, operator, *args, **kwargs) -> CheckpointPolicy:
    """policy="selective": keep the outputs of SAVED_OPERATORS, recompute the rest (a policy_fn for
    torch.utils.checkpoint.create_selective_checkpoint_contexts)."""
    return CheckpointPolicy.MUST_SAVE if operator in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED = _saved_overloads()
# torch 2.14 and later: what a selective region keeps goes through the saved-tensor hooks around it, as every other
# saved tensor does (save_on_cpu offloads it, gk.memory.breakdown counts it as saved activations); earlier
# versions keep it aside from the hooks.
_THROUGH_HOOKS = (
    {"respect_saved_tensors_hooks": True}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    else {}
)


def _buffers(modules: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, name, buffer) for every buffer in `modules`."""
    return [
        (owner, name, buffer)
        for module in modules
        for owner in module.modules()
        for name, buffer in owner._buffers.items()
        if buffer is not None
    ]


class _BuffersOfOneCall:
    """One call of a region: its buffers as they were before the forward, for the recomputation.

    Without checkpointing a region's forward runs once per step; with it, again in backward. The
    recomputation runs on copies of the buffers as they were before the forward (so it computes what
    the forward computed, even where the output depends on a buffer it updates), and the buffers the
    forward left are put back after it (so an EMA, a counter or BatchNorm's statistics are updated once
    per step). All buffers are copied: a write is not always visible (BatchNorm's kernel does not bump
    the version counter) and comparing values would wait for the GPU. The copies (BatchNorm's: a few
    kB per block) live until backward.
    """

    def __init__(self, region: _Region):
        self.region = region
        self.before: list[tuple[nn.Module, str, torch.Tensor]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        copies: dict[int, torch.Tensor] = {}  # id(buffer) -> its copy: tied buffers stay tied
        self.before = [
            (owner, name, copies.setdefault(id(buffer), buffer.detach().clone()))
            for owner, name, buffer in _buffers(self.region.modules)
        ]
        yield

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        after = _buffers(self.region.modules)
        copies: dict[int, torch.Tensor] = {}  # copies again: a second backward (retain_graph) recomputes too
        for owner, name, before in self.before:
            owner._buffers[name] = copies.setdefault(id(before), before.clone())
        try:
            yield
        finally:
            for owner, name, buffer in after:
                owner._buffers[name] = buffer


class _Region:
    """Modules checkpointed together: they run in order, and are recomputed in backward.

    A region of one module replaces that module's forward; `previous` is the forward it
    had (None: its class's). A region of several runs them through their own __call__.
    """

    def __init__(self, names: list[str], modules: list[nn.Module], previous=None, policy: str = "full"):
        self.names = names
        self.modules = modules
        self.previous = previous
        self.policy = policy

    def run(self, *args, **kwargs):
        if len(self.modules) == 1:
            module = self.modules[0]
            forward = self.previous if self.previous is not None else type(module).forward.__get__(module)
            return forward(*args, **kwargs)
        (output,) = args
        for module in self.modules:
            output = module(output)
        return output

    def _needs_gradients(self, args, kwargs) -> bool:
        """Whether backward goes through this call: decided per call, since inputs and freezing vary."""
        if any(parameter.requires_grad for module in self.modules for parameter in module.parameters()):
            return True
        return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves((args, kwargs)))

    def _contexts(self):
        """A region with buffers: the contexts that restore them around the recomputation (and SAC's)."""
        buffers = _BuffersOfOneCall(self)
        if self.policy == "full":
            return buffers.forward(), buffers.recomputation()
        keep, recompute = selective_contexts()
        if _THROUGH_HOOKS:  # checkpoint's argument reaches a bare SAC context only, not one combined with ours
            keep.respect_saved_tensors_hooks = True
        return _together(buffers.forward(), keep), _together(buffers.recomputation(), recompute)

    def __call__(self, *args, **kwargs):
        # Evaluation, or a frozen region on inputs without gradients: nothing is saved, nothing to recompute
        # (checkpoint would only keep the inputs).
        if not torch.is_grad_enabled() or not self._needs_gradients(args, kwargs):
            return self.run(*args, **kwargs)
        options = _THROUGH_HOOKS if self.policy == "selective" else {}
        if _buffers(self.modules):
            options |= {"context_fn": self._contexts}
        elif self.policy == "selective":  # a plain function: torch.compile traces it (it loses a method's self)
            options |= {"context_fn": selective_contexts}
        return checkpoint(self.run, *args, use_reentrant=False, **options, **kwargs)


def selective_contexts():
    """policy="selective"'s contexts for torch.utils.checkpoint.checkpoint(context_fn=...)."""
    return create_selective_checkpoint_contexts(selective_policy)


@contextlib.contextmanager
def _together(first, second) -> Iterator[None]:
    with first, second:
        yield


class _Sequence:
    """The forward of an nn.Sequential whose consecutive children form regions."""

    def __init__(self, container: nn.Sequential, starts: dict[int, _Region]):
        self.container = container
        self.starts = starts  # index of a region's first child -> region

    def __call__(self, input):
        children = list(self.container)
        index = 0
        while index < len(children):
            region = self.starts.get(index)
            if region is not None:
                input = region(input)
                index += len(region.modules)
            else:
                input = children[index](input)
                index += 1
        return input
