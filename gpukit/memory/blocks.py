"""A model's blocks: the children (with parameters and submodules of their own) of its outermost nn.Sequential or
nn.ModuleList containers, such as a ResNet's BasicBlocks or a transformer's layers. Activation checkpointing makes
its regions of them, FSDP2 shards each as a unit, regional compilation compiles each; an MLP's nn.Sequential of plain
layers has none, and `sequential_layers` gives its layers instead."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, block, parent) for each block: children of the outermost Sequential/ModuleList
    containers that have parameters and submodules of their own, in order."""
    blocks = []

    def visit(module: nn.Module, prefix: str) -> None:
        container = isinstance(module, (nn.Sequential, nn.ModuleList))
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if not container:
                visit(child, full)
            elif _has_parameters(child) and any(True for _ in child.children()):
                blocks.append((full, child, module))

    visit(model, "")
    return blocks


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, layer, parent) for each child of the model's outermost nn.Sequential (of two children or
    more, run by nn.Sequential's own forward): the layers of an MLP, which has no blocks."""
    for name, module in model.named_modules():
        if _runs_children_in_order(module) and len(module) >= 2:
            return [(f"{name}.{child}" if name else child, layer, module) for child, layer in module.named_children()]
    return []


def _runs_children_in_order(parent: nn.Module) -> bool:
    """True for an nn.Sequential that uses nn.Sequential's forward (so its children can be grouped)."""
    return isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward


def _group_blocks(blocks, size: int, notes: list[str]) -> list[list[tuple[str, nn.Module, nn.Module]]]:
    """Runs of up to `size` consecutive blocks of one parent; one block per run where the parent
    has its own forward (it may do more than call its children in order)."""
    groups, fallback = [], set()
    for name, block, parent in blocks:
        last = groups[-1] if groups else None
        if last is not None and last[-1][2] is parent and len(last) < size and _runs_children_in_order(parent):
            position = list(parent).index(block)
            if list(parent).index(last[-1][1]) == position - 1:
                last.append((name, block, parent))
                continue
        if size > 1 and not _runs_children_in_order(parent):
            fallback.add(type(parent).__name__)
        groups.append([(name, block, parent)])
    for parent_name in sorted(fallback):
        notes.append(
            f"{parent_name} runs its blocks in its own forward(), so they cannot be grouped: each of its blocks "
            "is a region of its own (more saved inputs, the same recomputation)."
        )
    return groups


def _named_modules(model: nn.Module, modules: Sequence[str | type]) -> list[tuple[str, nn.Module, nn.Module | None]]:
    named = dict(model.named_modules())
    chosen = []
    for item in modules:
        if isinstance(item, type):
            found = [(name, module) for name, module in named.items() if isinstance(module, item) and name]
            if not found:
                raise ValueError(f"the model has no {item.__name__} module; pass names from model.named_modules().")
            chosen += found
        elif item in named and item:
            chosen.append((item, named[item]))
        else:
            examples = ", ".join(repr(name) for name, *_ in find_blocks(model)[:6]) or ", ".join(
                repr(n) for n in list(named)[1:7]
            )
            raise ValueError(
                f"the model has no module named {item!r}; pass names from model.named_modules(), such as {examples}."
            )
    names = [name for name, _ in chosen]
    for name in names:
        inner = [other for other in names if other.startswith(name + ".")]
        if inner:
            raise ValueError(f"{inner[0]!r} lies inside {name!r}: checkpoint one or the other, not both.")
    return [(name, module, None) for name, module in dict(chosen).items()]
