"""Optimizers and learning-rate schedules by name: the one place a string becomes an object.

Names (`make_optimizer`):

    "nesterov"   SGD with Nesterov momentum 0.9 (fit's default)
    "momentum"   SGD with heavy-ball momentum 0.9
    "sgd"        deprecated: it has meant Nesterov momentum 0.9, which the name does not say; it warns
                 and stays "nesterov" for this release, then becomes plain SGD (no momentum)
    "adam"       Adam (weight decay added to the gradient, L2 style)
    "adamw"      AdamW (decoupled weight decay)
    "rmsprop"    RMSprop (no momentum)
    "adagrad"    Adagrad
    "lamb"       LAMB (layer-wise adaptive Adam, You et al. 2019), from timm: pip install 'gpukit[optim]'
    "lars"       LARS (layer-wise adaptive SGD with momentum 0.9, You et al. 2017), from timm
    "muon"       torch.optim.Muon (torch >= 2.9) for the hidden weight matrices, AdamW for the rest

A list of optimizers, each for its own parameters, is one `Combined` (SparseAdam for nn.Embedding(sparse=True)
tables beside Adam: gpukit.sparse_gradients, whose check refuses an optimizer that cannot apply sparse gradients).

No decay on biases and norm parameters: for "adamw", "lamb", "lars" and "muon" every parameter
with one dimension (biases, BatchNorm/LayerNorm scales and shifts) goes to a group with
weight_decay=0, as BERT, timm and nanoGPT do; decaying a norm's scale towards 0 only fights the
normalisation. `no_decay_1d=False` puts every parameter in one decayed group. The other names
apply `weight_decay` to every parameter (their classic form).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .sparse_gradients import Combined, check_sparse_gradients
from .validation import check_number

__all__ = [
    "DEFAULT_LRS",
    "OPTIMIZERS",
    "SCHEDULES",
    "Combined",
    "MuonWithAdamW",
    "check_lr",
    "default_lr",
    "make_optimizer",
    "make_schedule",
    "muon_parameters",
]

SCHEDULES = ("onecycle", "linear", "constant")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "lamb", "lars", "muon")
DEFAULT_LR = 0.05  # fit's peak learning rate for the SGD family given by name
# fit's peak learning rate for each name when none is given: the SGD family steps in the
# gradient's units, the adaptive ones in units of about one lr per coordinate, hence far smaller.
DEFAULT_LRS = {
    "sgd": DEFAULT_LR,
    "momentum": DEFAULT_LR,
    "nesterov": DEFAULT_LR,
    "lars": 1.0,
    "adam": 1e-3,
    "adamw": 1e-3,
    "rmsprop": 1e-3,
    "adagrad": 1e-2,
    "lamb": 1e-2,
    "muon": 1e-3,
}
NO_DECAY_BY_DEFAULT = ("adamw", "lamb", "lars", "muon")  # names whose 1-D parameters are not decayed
OPTIONAL_EXTRA = "pip install 'gpukit[optim]' (or pip install timm)"
MUON_TORCH = "2.9"


def check_lr(lr) -> None:
    check_number("lr", lr, note="(finite)")


def check_weight_decay(weight_decay) -> None:
    if (
        not isinstance(weight_decay, (int, float))
        or isinstance(weight_decay, bool)
        or not math.isfinite(weight_decay)
        or weight_decay < 0
    ):
        raise ValueError(f"weight_decay must be a finite number >= 0 (0 turns it off), got {weight_decay!r}.")


def default_lr(optimizer) -> float:
    """fit's peak learning rate for an optimizer name when none is given."""
    return DEFAULT_LRS.get(optimizer, DEFAULT_LR) if isinstance(optimizer, str) else DEFAULT_LR


def _check_name(name: str) -> None:
    if name == "sgd":
        warnings.warn(
            "optimizer='sgd' has meant SGD with Nesterov momentum 0.9; say optimizer='nesterov' (the same) "
            "or 'momentum'. In the next release 'sgd' will be plain SGD without momentum.",
            DeprecationWarning,
            stacklevel=5,  # (the caller of make_optimizer's caller, through _built)
        )
    if name not in OPTIMIZERS:
        raise ValueError(
            f"optimizer={name!r} is unknown; use one of {', '.join(map(repr, OPTIMIZERS))}, a torch.optim.Optimizer, "
            "or a function of the parameters that returns one."
        )


def decay_groups(parameters: Iterable, weight_decay: float, no_decay_1d: bool = True) -> list[dict]:
    """Parameter groups: matrices and filters (2-D and more) decayed, 1-D parameters (biases, norm
    scales and shifts) with weight_decay=0. Empty groups are left out; a parameter seen twice
    (tied weights) is kept once."""
    unique = list({id(p): p for p in parameters if p.requires_grad}.values())
    if not no_decay_1d:
        return [{"params": unique, "weight_decay": weight_decay}]
    decayed = [p for p in unique if p.dim() >= 2]
    plain = [p for p in unique if p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _timm(name: str):
    try:
        from timm.optim import Lamb, Lars
    except ImportError as error:
        raise ImportError(
            f"optimizer={name!r} comes from the timm library, which is not installed; {OPTIONAL_EXTRA}."
        ) from error
    return Lamb if name == "lamb" else Lars


def make_optimizer(
    optimizer: str | torch.optim.Optimizer | list[torch.optim.Optimizer] | Callable,
    parameters: Iterable | nn.Module,
    lr: float,
    weight_decay: float,
    *,
    no_decay_1d: bool | None = None,
) -> torch.optim.Optimizer:
    """An optimizer from a name (see the module docstring), an Optimizer (returned as it is), a list of
    them (each for its own parameters: one `Combined`), or a function of the parameters that returns one.

    parameters: a model, or its parameters. "muon" needs the model (it must tell the hidden
        weights from the embeddings and the output head); given bare parameters it treats every
        2-D parameter as hidden. Given the model, an optimizer that cannot apply the sparse gradients
        of its nn.Embedding(sparse=True) tables is refused (check_sparse_gradients).
    no_decay_1d: None means True for "adamw", "lamb", "lars" and "muon", False for the others.
    """
    built = _built(optimizer, parameters, lr, weight_decay, no_decay_1d)
    if isinstance(parameters, nn.Module):
        check_sparse_gradients(parameters, built, optimizer if isinstance(optimizer, str) else None)
    return built


def _built(optimizer, parameters, lr: float, weight_decay: float, no_decay_1d: bool | None) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        return Combined(optimizer)
    if callable(optimizer) and not isinstance(optimizer, str):
        built = optimizer(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer function returned {type(built).__name__}, not a torch.optim.Optimizer.")
        return built
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be a name, a torch.optim.Optimizer or a function of the parameters, got "
            f"{type(optimizer).__name__}."
        )
    _check_name(optimizer)
    check_lr(lr)
    check_weight_decay(weight_decay)
    no_decay = optimizer in NO_DECAY_BY_DEFAULT if no_decay_1d is None else no_decay_1d
    if optimizer == "muon":
        return muon_with_adamw(parameters, lr=lr, weight_decay=weight_decay, no_decay_1d=no_decay)
    model_parameters = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    optimizer_class, options = optimizer_class_and_options(optimizer)
    return optimizer_class(decay_groups(model_parameters, weight_decay, no_decay), lr=lr, **options)


def optimizer_class_and_options(name: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The class a name stands for and its options besides lr and weight_decay (for wrappers such
    as ZeroRedundancyOptimizer, which build the optimizer themselves). Not for "muon" (two optimizers)."""
    _check_name(name)
    if name in ("sgd", "nesterov", "momentum"):
        return torch.optim.SGD, {"momentum": 0.9, "nesterov": name != "momentum"}
    if name == "lars":
        return _timm("lars"), {"momentum": 0.9}
    if name == "lamb":
        return _timm("lamb"), {}
    if name == "muon":
        raise ValueError("'muon' is two optimizers (Muon and AdamW), not one class; build it with make_optimizer.")
    classes = {
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "rmsprop": torch.optim.RMSprop,
        "adagrad": torch.optim.Adagrad,
    }
    return classes[name], {}


# ---------------------------------------------------------------------------------------------
# Muon


def muon_parameters(model: nn.Module | Iterable) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden weights for Muon, the rest for AdamW), as Muon's authors split them.

    Muon orthogonalises each update matrix, which suits the weights of hidden layers: linear
    weights (2-D) and convolution filters (4-D, seen as out_channels × (in_channels·kh·kw) as in
    Keller Jordan's CIFAR-10 runs). Embeddings (a lookup, not a matrix product), the output head
    (the last nn.Linear, and any weight tied to an embedding), and 1-D parameters go to AdamW.
    """
    if not isinstance(model, nn.Module):
        parameters = list({id(p): p for p in model if p.requires_grad}.values())
        return [p for p in parameters if p.dim() >= 2], [p for p in parameters if p.dim() < 2]
    excluded = set()
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    if linears:
        excluded.add(id(linears[-1].weight))  # the output head
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            excluded.add(id(module.weight))
    parameters = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    hidden = [p for p in parameters if p.dim() >= 2 and id(p) not in excluded]
    rest = [p for p in parameters if not (p.dim() >= 2 and id(p) not in excluded)]
    return hidden, rest


def _is_channels_last(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)


def _as_matrix(tensor: torch.Tensor, permuted: bool, copy_ok: bool = False) -> torch.Tensor:
    """(out, everything else): a filter (O, I, kh, kw) as a matrix. A channels_last filter is read
    as (O, kh, kw, I), its order in memory; orthogonalisation commutes with permuting columns."""
    matrix = tensor.permute(0, 2, 3, 1) if permuted else tensor
    return matrix.reshape(matrix.shape[0], -1) if copy_ok else matrix.view(matrix.shape[0], -1)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the hidden weights, torch.optim.AdamW for every other parameter, as one
    optimizer: a learning-rate schedule, gradient clipping, loss scaling and checkpoints see one
    set of parameter groups (group 0 is Muon's; the others AdamW's).

    Muon runs with adjust_lr_fn="match_rms_adamw" (Moonshot AI's scaling, which gives its updates
    the RMS of AdamW's), so one learning rate and weight decay suit both halves. Filters with more
    than two dimensions are updated through a 2-D view of the same storage (torch's Muon takes
    matrices only). The groups' lr and weight_decay are read at every step.
    """

    def __init__(self, hidden: list, rest: list, *, lr: float, weight_decay: float, no_decay_1d: bool = True):
        muon_class = getattr(torch.optim, "Muon", None)
        if muon_class is None:
            raise ImportError(
                f"optimizer='muon' needs torch.optim.Muon, added in torch {MUON_TORCH}; this torch is "
                f"{torch.__version__}. Upgrade torch (pip install 'torch>={MUON_TORCH}') or pick another optimizer."
            )
        if not hidden:
            raise ValueError(
                "optimizer='muon' found no hidden weight matrix for Muon (2-D or more, not an embedding or the output "
                "head); use 'adamw' for this model."
            )
        groups = [{"params": hidden, "weight_decay": weight_decay}, *decay_groups(rest, weight_decay, no_decay_1d)]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        # 2-D views sharing storage with the hidden weights: Muon's updates land in the weights.
        self._permuted = [_is_channels_last(p) for p in hidden]
        self._views = [_as_matrix(p.detach(), permuted) for p, permuted in zip(hidden, self._permuted)]
        self.muon = muon_class(self._views, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([dict(group) for group in self.param_groups[1:]], lr=lr)

    @property
    def state(self) -> dict:
        """Both optimizers' state, keyed by the model's parameters (Muon's momentum, AdamW's moments)."""
        merged = {
            p: self.muon.state[view]
            for p, view in zip(self.param_groups[0]["params"], self._views)
            if view in self.muon.state
        }
        return merged | dict(self.adamw.state)

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ assigns an empty state: kept in the parts
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, [*self.muon.param_groups, *self.adamw.param_groups]):
            inner["lr"], inner["weight_decay"] = outer["lr"], outer["weight_decay"]
        for p, view, permuted in zip(self.param_groups[0]["params"], self._views, self._permuted):
            view.grad = None if p.grad is None else _as_matrix(p.grad, permuted, copy_ok=True)
        self.muon.step()
        self.adamw.step()
        for view in self._views:
            view.grad = None
        return loss

    def state_dict(self) -> dict:
        return {
            "muon": self.muon.state_dict(),
            "adamw": self.adamw.state_dict(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        for group, saved in zip(self.param_groups, state_dict["groups"]):
            group.update(saved)


def muon_with_adamw(model, *, lr: float, weight_decay: float, no_decay_1d: bool = True) -> MuonWithAdamW:
    """The "muon" optimizer: torch.optim.Muon on the hidden weights (see muon_parameters), AdamW on the rest."""
    hidden, rest = muon_parameters(model)
    return MuonWithAdamW(hidden, rest, lr=lr, weight_decay=weight_decay, no_decay_1d=no_decay_1d)


# ---------------------------------------------------------------------------------------------
# Schedules


def _onecycle_warmup_fraction(warmup_steps: float, total_steps: int) -> float:
    """OneCycleLR's pct_start for a warm-up of `warmup_steps`: the peak is reached at step warmup_steps - 1.

    OneCycleLR ends its warm-up at step float(pct_start * total_steps) - 1 and divides by that step; where it is
    exactly 0 (a warm-up of one step: max_steps=5 with warmup=0.2, or warmup=0 over 10**6 steps) it divides 0
    by 0. A fraction a few units in the last place smaller makes it a warm-up shorter than one step, as any
    warm-up below one step is: the first step is at the peak.
    """
    fraction = max(warmup_steps / total_steps, 1e-6)
    while float(fraction * total_steps) - 1 == 0:
        fraction = math.nextafter(fraction, 0.0)
    return fraction


def _cosine_from_peak(step: int, total_steps: int) -> float:
    """The one-cycle schedule's decay without its warm-up: the peak at step 0, then OneCycleLR's cosine annealing to
    its final lr (the peak / 25 / 10**4) at step total_steps. (OneCycleLR itself starts a step into its decay there.)"""
    final = 1 / (25.0 * 1e4)
    return final + (1 - final) * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)) / 2


def make_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, total_steps: int | None, warmup: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then one-cycle (cosine) decay, linear decay to zero, or constant.

    The peak is each parameter group's learning rate. `warmup` is a fraction of all steps (< 1)
    or a number of steps (>= 1; fit takes those as an int warmup). The one-cycle schedule is torch's OneCycleLR, with the learning
    rate only (momentum is left as set). `total_steps=None` (an unknown length) is allowed only
    for the constant schedule with warm-up given in steps.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")
    if total_steps is None:
        if schedule != "constant" or 0 < warmup < 1:
            raise ValueError(
                f"the {schedule!r} schedule needs the number of steps; pass max_steps, or use schedule='constant' "
                "with warmup in steps (warmup=0 or e.g. warmup=100)."
            )
        total_steps = math.inf
    total_steps = max(total_steps, 1)
    warmup_steps = warmup * total_steps if warmup < 1 else warmup
    warmup_steps = min(max(warmup_steps, 0), total_steps)
    if schedule == "onecycle" and warmup_steps < 1:  # OneCycleLR cannot start at its peak: cosine from it by hand
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _cosine_from_peak(step, total_steps))
    if schedule == "onecycle":
        peak = [group["lr"] for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=peak,
            total_steps=total_steps + 1,
            pct_start=_onecycle_warmup_fraction(warmup_steps, total_steps + 1),
            anneal_strategy="cos",
            cycle_momentum=False,
            div_factor=25.0,
            final_div_factor=1e4,
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(total_steps - warmup_steps, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
