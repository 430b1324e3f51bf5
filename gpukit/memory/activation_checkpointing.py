"""Activation (gradient) checkpointing applied to a model without editing its code.

A checkpointed region keeps only its inputs in the forward pass, and runs its forward again in the
backward pass to get back the activations it needs: memory traded for compute, at most one extra forward
pass of FLOPs. In time that holds for a compute-bound step (ResNet-50 at 224², batch 128, on an H100: 1.4-1.5x);
a small step bound by per-operator overhead pays a whole extra forward of launches and bookkeeping (the kit's 32x32
ResNet-18, a 12 ms step on the H100: 2.4-3.0x; lesson 03). Regions use torch.utils.checkpoint (use_reentrant=False).

Regions are made of *blocks*: the children (with parameters and submodules of their own) of the model's
outermost nn.Sequential or nn.ModuleList containers: a ResNet's BasicBlocks, a transformer's layers (a
Hugging Face model's too). Choose them with one of

    every=k        a region every k consecutive blocks (k=1, the default: every block);
    segments=m     about m regions of consecutive blocks ("sqrt": about sqrt(n) of n blocks);
    modules=[...]  the named modules (names from model.named_modules(), or module classes).

An nn.Sequential of plain layers without blocks (an MLP) is split as checkpoint_sequential splits it, the
last segment left as it is; a model with neither (an MLP class of its own, a ModuleList of Linear experts)
gets an error that says what was searched and found, and how to name modules=[...]. With `batch=`, one
training step is measured before and after (gk.memory.breakdown), and a peak that did not drop is warned of.

Inside a region, `policy` chooses what is kept: "full" (the default) keeps only the region's inputs and runs
its whole forward again; "selective" keeps the outputs of the expensive operators, matrix products,
convolutions and attention (SAVED_OPERATORS), and recomputes only the cheap ones between them (norms,
activations, residual adds, reshapes), as torchtitan's per-op selective checkpointing does with
torch.utils.checkpoint.create_selective_checkpoint_contexts. Measured on a 4-block GPT (width 256, 128 tokens,
batch 16) on a CPU: full kept 10% of the forward's memory, selective 70% (issue 21's reference run: +19% and
+13% step time). On a GPU the recomputed operators are memory-bound and cheap next to the matmuls, so
selective should cost only a few percent.

What stays as without checkpointing: module names, parameters and the state_dict (`forward` is replaced on
the instance; remove_activation_checkpointing(model) puts it back); every buffer a region changes in forward
(BatchNorm's statistics, an EMA, a step counter): the recomputation runs on the values the forward saw and
the buffers end the step as the forward left them (a copy of a region's buffers is kept from forward to
backward: BatchNorm's are a few kB). A call of a region with no trainable parameter and no input that needs
a gradient (a frozen backbone; the plan names such regions) runs plainly: nothing to recompute. A model whose
config has use_cache=True (Hugging Face) gets use_cache=False, as gradient_checkpointing_enable does: a
cache filled in a region would be filled again by the recomputation; removal sets it back. Forward hooks
inside a region run again during the recomputation.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from ..deprecation import renamed
from ..report import format_bytes

# What a block is (blocks.py), and the regions made of them, recomputed in backward (recomputation.py).
from .blocks import _group_blocks, _has_parameters, _named_modules, find_blocks, sequential_layers
from .measuring import breakdown
from .recomputation import SAVED_OPERATORS, _Region, _Sequence, selective_contexts, selective_policy

__all__ = [
    "POLICIES",
    "SAVED_OPERATORS",
    "ActivationCheckpointingPlan",
    "apply_activation_checkpointing",
    "check_policy",
    "find_blocks",
    "has_activation_checkpointing",
    "remove_activation_checkpointing",
    "selective_contexts",
    "selective_policy",
    "sequential_layers",
]

_PLAN = "_gpukit_checkpointing"  # the attribute that holds a model's ActivationCheckpointingPlan
POLICIES = ("full", "selective")


@dataclass
class ActivationCheckpointingPlan:
    """What apply_activation_checkpointing did: the model's blocks (or an MLP's layers) and the regions made of them."""

    model_name: str
    blocks: list[str]
    regions: list[list[str]]
    notes: list[str] = field(default_factory=list)
    patched: list[tuple[nn.Module, object]] = field(default_factory=list, repr=False)  # (module, previous forward)
    peak_before: int | None = None  # bytes: one training step's measured peak without and with (given a batch)
    peak_after: int | None = None
    found: str = "blocks"  # what `blocks` names: "blocks", or "layers" of an nn.Sequential without blocks
    kinds: dict[str, int] = field(default_factory=dict)  # class name -> how many modules of it were wrapped
    caches: list[object] = field(default_factory=list, repr=False)  # configs whose use_cache was set to False
    policy: str = "full"  # what a region keeps: "full" (its inputs only) or "selective" (matmul/attention outputs)

    def __str__(self) -> str:
        shown = ", ".join("+".join(region) for region in self.regions[:8]) + (", …" if len(self.regions) > 8 else "")
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.kinds.items())
        kept = "" if self.policy == "full" else ", selective (matmul, convolution and attention outputs kept)"
        text = (
            f"{self.model_name}: {sum(map(len, self.regions))} modules ({kinds}) checkpointed{kept} in "
            f"{len(self.regions)} regions ({len(self.blocks)} {self.found} found): {shown}"
        )
        if self.peak_before is not None:
            text += (
                f"\nmeasured peak of a training step: {format_bytes(self.peak_before)} without, "
                f"{format_bytes(self.peak_after)} with"
            )
        return "\n".join([text, *self.notes])


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    every: int | None = None,
    segments: int | str | None = None,
    modules: Sequence[str | type] | None = None,
    batch=None,
    policy: str = "full",
) -> ActivationCheckpointingPlan:
    """Checkpoint regions of `model` in place and return the plan (print it to see the regions).

    Give at most one of `every` (a region every k blocks; default 1), `segments` (about m
    regions, or "sqrt"), `modules` (names or classes). See the module docstring for what a
    block is; `find_blocks(model)` lists them, and an MLP's nn.Sequential of layers is split into
    segments. `batch`, an example batch of any form fit takes: one training step is measured
    without and with (on a copy), and a peak that did not drop is said in the plan and warned
    about. `policy`: "full" recomputes a region's whole forward, "selective" keeps the outputs of
    SAVED_OPERATORS (matmuls, convolutions, attention) and recomputes the rest. Undo with
    remove_activation_checkpointing(model).
    """
    _check_options(model, policy, every, segments, modules)
    notes: list[str] = []
    groups, blocks, found = _choose_regions(model, every, segments, modules, notes)
    plan = ActivationCheckpointingPlan(
        type(model).__name__, blocks, [[name for name, *_ in group] for group in groups], notes, found=found
    )
    plan.policy = policy
    plan.kinds = dict(Counter(type(module).__name__ for group in groups for _, module, _ in group))
    _note_frozen_regions(groups, notes)
    before = _measured_peak(model, batch)
    _turn_off_caches(model, plan)
    containers: dict[int, tuple[nn.Sequential, dict[int, _Region]]] = {}
    for group in groups:
        names, members = [name for name, *_ in group], [module for _, module, _ in group]
        if len(group) == 1:
            module = members[0]
            previous = module.__dict__.get("forward")
            plan.patched.append((module, previous))
            module.forward = _Region(names, members, previous, policy)
        else:
            parent = group[0][2]
            _, starts = containers.setdefault(id(parent), (parent, {}))
            starts[list(parent).index(members[0])] = _Region(names, members, policy=policy)
    for parent, starts in containers.values():
        plan.patched.append((parent, parent.__dict__.get("forward")))
        parent.forward = _Sequence(parent, starts)
    setattr(model, _PLAN, plan)
    if before is not None:
        _compare_peaks(plan, before, _measured_peak(model, batch))
    return plan


def _check_options(model, policy: str, every, segments, modules) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    check_policy(policy)
    if sum(choice is not None for choice in (every, segments, modules)) > 1:
        raise ValueError("choose regions one way: every=k, segments=m or modules=[...], not several.")
    if getattr(model, _PLAN, None) is not None:
        raise ValueError(
            "this model is already checkpointed; call gk.memory.remove_activation_checkpointing(model) first."
        )


def check_policy(policy) -> None:
    if policy not in POLICIES:
        raise ValueError(
            f"activation checkpointing policy {policy!r} is unknown; use 'full' (recompute each block whole) or "
            "'selective' (keep matmul and attention outputs, recompute the rest)."
        )


def _note_frozen_regions(groups: list[list[tuple]], notes: list[str]) -> None:
    frozen = [
        "+".join(name for name, *_ in group)
        for group in groups
        if not any(parameter.requires_grad for _, module, _ in group for parameter in module.parameters())
    ]
    if frozen:
        shown = ", ".join(frozen[:6]) + (", …" if len(frozen) > 6 else "")
        notes.append(
            f"{len(frozen)} regions have no trainable parameter ({shown}): a call whose inputs need no gradient "
            "either (a frozen backbone's) runs without checkpointing, which would keep its inputs for nothing."
        )


def _turn_off_caches(model: nn.Module, plan: ActivationCheckpointingPlan) -> None:
    """use_cache=False in every config of the model that has use_cache=True (Hugging Face models)."""
    configs = {id(config): config for config in (getattr(module, "config", None) for module in model.modules())}
    plan.caches = [config for config in configs.values() if getattr(config, "use_cache", None) is True]
    for config in plan.caches:
        config.use_cache = False
    if plan.caches:
        plan.notes.append(
            "config.use_cache set to False, as Hugging Face's gradient_checkpointing_enable does: a key/value cache "
            "filled inside a region would be filled again by the recomputation. "
            "gk.memory.remove_activation_checkpointing(model) sets it back."
        )


def _choose_regions(model, every, segments, modules, notes: list[str]) -> tuple[list[list[tuple]], list[str], str]:
    """The regions (each a list of (name, module, parent)), the names of the blocks (or layers) they were
    chosen from, and which of the two those are."""
    if modules is not None:
        groups = [[chosen] for chosen in _named_modules(model, modules)]
        return groups, [name for name, *_ in find_blocks(model)], "blocks"
    found, layers = find_blocks(model), False
    if not found:
        found, layers = sequential_layers(model), True
        if not found:
            raise _no_blocks(model)
        if every is None and segments is None:
            segments = "sqrt"
    if segments is not None:
        if segments == "sqrt":
            segments = max(round(math.sqrt(len(found))), 2 if layers else 1)
        if not isinstance(segments, int) or segments < 1:
            raise ValueError(f"segments must be a positive integer or 'sqrt', got {segments!r}.")
        every = math.ceil(len(found) / segments)
    every = 1 if every is None else every
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive integer (blocks per region), got {every!r}.")
    groups = _group_blocks(found, every, notes)
    if layers and len(groups) < 2:
        raise ValueError(
            f"{len(found)} layers in one segment leave nothing to checkpoint (the last segment runs without it); "
            "use segments=2 or more, every=k with k below the number of layers, or the default ('sqrt')."
        )
    if layers:
        notes.append(
            f"{type(found[0][2]).__name__} of {len(found)} layers without blocks: split into {len(groups)} segments "
            "as torch.utils.checkpoint.checkpoint_sequential does; the last runs without checkpointing (backward "
            "needs its activations at once)."
        )
        groups = groups[:-1]
    return groups, [name for name, *_ in found], "layers" if layers else "blocks"


def _no_blocks(model: nn.Module) -> ValueError:
    """What was searched and found in a model without blocks, and what to pass instead."""
    containers = [
        f"{type(module).__name__} {name!r} of "
        + ", ".join(f"{count} {kind}" for kind, count in Counter(type(child).__name__ for child in module).items())
        for name, module in model.named_modules()
        if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module)
    ]
    found = "found none"
    if containers:
        found = f"found only {'; '.join(containers[:3])}: no children with submodules, nor layers run in order"
    # examples: the model's parts with parameters, a ModuleList's members in its place (it has no forward)
    names = [
        f"{name}.{member}" if isinstance(child, nn.ModuleList) else name
        for name, child in model.named_children()
        for member in (range(len(child)) if isinstance(child, nn.ModuleList) else [None])
        if _has_parameters(child)
    ][:4]
    layers = Counter(
        type(m) for name, m in model.named_modules() if name and _has_parameters(m) and not len(m._modules)
    )
    examples = [f"modules=[{', '.join(map(repr, names))}]"] if names else []
    if layers:
        kind = layers.most_common(1)[0][0]
        examples.append(f"modules=[{'nn.' if kind.__module__.startswith('torch.nn') else ''}{kind.__name__}]")
    return ValueError(
        f"found no blocks to checkpoint in {type(model).__name__}: searched its nn.Sequential and nn.ModuleList "
        f"containers for blocks (children with parameters and submodules of their own) and {found}; there is no "
        "nn.Sequential of layers to split either. Pass modules=[...] with the parts to checkpoint"
        + (f", such as {' or '.join(examples)}" if examples else "")
        + " (names from model.named_modules(), or module classes)."
    )


def _measured_peak(model: nn.Module, batch) -> int | None:
    """One training step's measured peak in bytes (gk.memory.breakdown, on a copy), or None without a batch."""
    if batch is None:
        return None
    parameter = next(model.parameters(), None)
    return breakdown(model, batch, device=parameter.device if parameter is not None else "cpu").total


def _compare_peaks(plan: ActivationCheckpointingPlan, before: int, after: int) -> None:
    plan.peak_before, plan.peak_after = before, after
    if after < before:
        return
    note = (
        f"activation checkpointing did not lower the measured peak of a training step ({format_bytes(before)} "
        f"without, {format_bytes(after)} with): the peak is not in saved activations here (it may be the "
        "weights, gradients and optimizer state, or a batch too small to matter). Undo it with "
        "gk.memory.remove_activation_checkpointing(model), or try a larger batch or other regions."
    )
    plan.notes.append(note)
    warnings.warn(note, stacklevel=3)


def remove_activation_checkpointing(model: nn.Module) -> None:
    """Undo apply_activation_checkpointing: every module gets back the forward it had."""
    plan = getattr(model, _PLAN, None)
    if plan is None:
        raise ValueError("this model is not checkpointed (apply_activation_checkpointing was not called on it).")
    for module, previous in reversed(plan.patched):
        if previous is None:
            del module.forward
        else:
            module.forward = previous
    for config in plan.caches:
        config.use_cache = True
    delattr(model, _PLAN)


def has_activation_checkpointing(model: nn.Module) -> bool:
    return getattr(model, _PLAN, None) is not None


__getattr__ = renamed(
    __name__,
    {
        "apply_checkpointing": "gpukit.memory.activation_checkpointing:apply_activation_checkpointing",
        "remove_checkpointing": "gpukit.memory.activation_checkpointing:remove_activation_checkpointing",
        "is_checkpointed": "gpukit.memory.activation_checkpointing:has_activation_checkpointing",
        "CheckpointPlan": "gpukit.memory.activation_checkpointing:ActivationCheckpointingPlan",
    },
)
