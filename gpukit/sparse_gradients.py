"""Sparse gradients, and several optimizers as one.

An nn.Embedding(sparse=True) (or EmbeddingBag) gets a sparse gradient, one row per id looked up: its indices (int64)
and values. Only torch.optim.SparseAdam, and SGD and Adagrad without weight decay, can apply one
(`check_sparse_gradients` refuses any other optimizer of such a table when it is built). The usual recipe gives the
tables SparseAdam and the rest Adam: `Combined` makes the two one optimizer, which fit, a schedule, loss scaling,
clipping and checkpoints see as one (fit(optimizer=[SparseAdam(...), Adam(...)]) builds it).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Combined", "check_sparse_gradients", "sparse_tables"]

SPARSE_READY = (torch.optim.SparseAdam, torch.optim.SGD, torch.optim.Adagrad)  # SGD, Adagrad: without weight decay


def sparse_tables(model: nn.Module) -> dict[int, str]:
    """{id(weight): name} of the model's nn.Embedding(sparse=True) and EmbeddingBag(sparse=True) tables that train."""
    return {
        id(module.weight): name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad
    }


def check_sparse_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, name: str | None = None) -> None:
    """Refuse, before any step, an optimizer that cannot apply the sparse gradients of an nn.Embedding(sparse=True)
    (or EmbeddingBag) it updates: torch's would fail at the first step with "add(sparse, dense) is not supported".
    SparseAdam can, and SGD and Adagrad without weight decay; an optimizer from outside torch and gpukit is trusted.
    `name`: the name the optimizer was built from, if it was."""
    tables = sparse_tables(model)
    for part in getattr(optimizer, "optimizers", [optimizer]):
        if name is None and type(part).__module__.split(".")[0] not in ("torch", "gpukit"):
            continue
        for group in part.param_groups:
            found = [tables[id(parameter)] for parameter in group["params"] if id(parameter) in tables]
            decay = group.get("weight_decay") or 0
            if not found or (isinstance(part, SPARSE_READY) and not decay):
                continue
            kind = f"optimizer={name!r}" if name is not None else type(part).__name__
            cannot = f"{kind} with weight_decay={decay:g}" if isinstance(part, SPARSE_READY) else kind
            raise ValueError(
                f"the embedding {found[0]!r} is built with sparse=True, so its gradients are sparse, which {cannot} "
                "cannot apply. Give the sparse tables torch.optim.SparseAdam and the rest another optimizer: "
                f"optimizer=[torch.optim.SparseAdam(model.{found[0]}.parameters()), torch.optim.Adam(the other "
                "parameters)]; or train them with SGD or Adagrad without weight decay (e.g. optimizer='momentum', "
                "weight_decay=0); or build the embedding with sparse=False."
            )


class Combined(torch.optim.Optimizer):
    """Several optimizers as one, each updating its own parameters: SparseAdam for sparse embeddings beside Adam for
    the rest (fit(optimizer=[SparseAdam(...), Adam(...)]) builds it). Their parameter groups, in order, are its own
    (the same dicts: a schedule's lr reaches each), `step` steps each in turn (their step hooks run), and its state
    is each one's."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        if not self.optimizers or not all(isinstance(part, torch.optim.Optimizer) for part in self.optimizers):
            raise TypeError(
                f"optimizer=[...] takes torch.optim.Optimizers, each built for its own parameters, got "
                f"{[type(part).__name__ for part in self.optimizers]}."
            )
        owners = [id(p) for part in self.optimizers for group in part.param_groups for p in group["params"]]
        if len(owners) != len(set(owners)):
            raise ValueError(
                "optimizer=[...]: a parameter is in two of the optimizers, which would both update it; give each "
                "optimizer its own parameters."
            )
        super().__init__(self._groups(), {})

    def _groups(self) -> list[dict]:
        return [group for part in self.optimizers for group in part.param_groups]

    @property
    def state(self) -> dict:
        """Every optimizer's state, keyed by its parameters."""
        return {parameter: value for part in self.optimizers for parameter, value in part.state.items()}

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ assigns an empty state: kept in the parts
        pass

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.optimizers:
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {"optimizers": [part.state_dict() for part in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the state holds {len(saved)} optimizers' states, this has {len(self.optimizers)}.")
        for part, state in zip(self.optimizers, saved):
            part.load_state_dict(state)
        self.param_groups = self._groups()  # each loaded optimizer made new group dicts: share them again
