"""Count what a piece of code sends between ranks: every collective it issues, with its bytes, seen where
torch dispatches it to the process group, not where the code decides to communicate.

    with gk.distributed.count_collectives() as sent:
        loss.backward()  # under DDP: the gradient all-reduces
    sent.calls("allreduce"), sent.bytes("allreduce")

DDP's own all-reduces (issued by its C++ reducer during backward) go through the same dispatcher as a
`torch.distributed.all_reduce` written in Python, so both are counted; so are FSDP2's functional collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operator namespaces of collectives: c10d (torch.distributed's in-place ops, DDP) and the functional ones (FSDP2).
_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass(frozen=True)
class Collective:
    """One collective call: its name without namespace or trailing underscore ("allreduce", "broadcast", ...)
    and the bytes of every tensor it was given (for all-reduce and broadcast: the message)."""

    name: str
    bytes: int


class count_collectives(TorchDispatchMode):  # noqa: N801 - used as a context manager, named like one
    """A context manager that records every collective this process issues inside it (`.log`, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES:
            tensors = [value for value in tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)]
            name = func._schema.name.split("::")[-1].rstrip("_")
            self.log.append(Collective(name, sum(tensor.nbytes for tensor in tensors)))
        return func(*args, **kwargs)

    def calls(self, name: str) -> int:
        """How many collectives called `name` ("allreduce", "broadcast", ...) were issued."""
        return sum(1 for call in self.log if call.name == name)

    def bytes(self, name: str) -> int:
        """The bytes those collectives were given, in all."""
        return sum(call.bytes for call in self.log if call.name == name)
