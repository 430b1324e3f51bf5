"""What a save holds beside the weights, and what resuming it checks, for gpukit.train.checkpoint:

- every global generator (torch's CPU one, the CUDA device's, NumPy's and Python's `random`) and every generator
  the loader, its sampler or batch sampler hold, with the `state_dict()` of a sampler that has one: where the data
  stands, and what the next random draw is;
- the running sums of the epoch (fit's Tally) and of its log window, which stay on the device between saves;
- the optimizer's settings that no schedule changes, compared with this call's (and the model's, and which parameters
  train), so that a resume with other settings is refused, naming them.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.ao.quantization import FakeQuantizeBase, ObserverBase
from torch.utils.data import DataLoader, IterableDataset

from .checkpoint_file import CheckpointError
from .tally import callers_stacklevel

# Keys a schedule writes into the optimizer's groups: the rest (weight_decay, momentum, betas, ...) shape the run.
# ("step": timm's LAMB counts its steps in each group.)
_SCHEDULE_KEYS = ("params", "lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "step")


# ---------------------------------------------------------------------------------------------
# Generators: the global ones, and those a loader holds


def _save_generator(generator) -> tuple | None:
    if isinstance(generator, torch.Generator):
        return ("torch", generator.get_state())
    if isinstance(generator, np.random.Generator):
        return ("numpy", generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        name, keys, position, has_gauss, gauss = generator.get_state()
        return ("numpy-legacy", (name, keys.tolist(), position, has_gauss, gauss))
    if isinstance(generator, random.Random):
        return ("python", generator.getstate())
    return None


def _load_generator(generator, saved: tuple) -> None:
    kind, state = saved
    if kind == "torch":
        generator.set_state(state)
    elif kind == "numpy":
        generator.bit_generator.state = state
    elif kind == "numpy-legacy":
        name, keys, position, has_gauss, gauss = state
        generator.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    else:
        generator.setstate(state)


def global_generators(device: torch.device) -> dict:
    """Every global generator's state: torch's CPU one, the CUDA device's (on CUDA), NumPy's and Python's."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": _save_generator(np.random.mtrand._rand),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def torch_generators(device: torch.device) -> dict:
    """torch's global generators alone (2 µs; NumPy's state takes about 100): what the order of
    torch's and gpukit's loaders draws from, taken at every epoch's start without a checkpoint_dir."""
    return {"torch": torch.get_rng_state()} | (
        {"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}
    )


def restore_global_generators(state: dict, device: torch.device) -> None:
    """Put back what global_generators (or torch_generators: NumPy's and Python's then left as they are) took."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        _load_generator(np.random.mtrand._rand, state["numpy"])
        random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _order_parts(loader) -> dict[str, object]:
    """What decides the order of `loader`'s batches, by role."""
    if not isinstance(loader, DataLoader):
        return {"data": loader}
    parts = {"loader": loader, "sampler": loader.sampler, "batch_sampler": loader.batch_sampler}
    parts["batch_sampler.sampler"] = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(loader.dataset, IterableDataset):
        parts["dataset"] = loader.dataset
    return {role: part for role, part in parts.items() if part is not None}


def _stateful(part) -> bool:
    return callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))


def order_state(loader) -> dict:
    """The state `loader`'s next epoch draws its order from: its parts' generators and state_dicts."""
    state = {}
    for role, part in _order_parts(loader).items():
        attributes = getattr(part, "__dict__", {})
        saved = {name: _save_generator(value) for name, value in attributes.items()}
        state[role] = {"generators": {name: value for name, value in saved.items() if value is not None}}
        if _stateful(part) and not isinstance(part, DataLoader):
            state[role]["state_dict"] = part.state_dict()
    return state


def restore_order(loader, state: dict) -> None:
    for role, part in _order_parts(loader).items():
        saved = state.get(role, {})
        if "state_dict" in saved:
            part.load_state_dict(saved["state_dict"])
        for name, generator in saved.get("generators", {}).items():
            _load_generator(getattr(part, name), generator)


def _replayable(part) -> bool:
    module = type(part).__module__
    return (
        isinstance(part, (list, tuple))
        or module.startswith(("torch.utils.data", "gpukit."))
        or (_stateful(part) and not isinstance(part, DataLoader))
    )


def order_replayable(loader) -> bool:
    """Whether every part that decides `loader`'s order is put back by order_state and the global generators."""
    return all(_replayable(part) for part in _order_parts(loader).values())


def warn_if_order_cannot_be_saved(loader) -> None:
    """A warning, before any work, where a resumed run may not see the batches an uninterrupted one would."""
    problems = [
        f"its {role} is a {type(part).__name__} without state_dict()/load_state_dict()"
        for role, part in _order_parts(loader).items()
        if not _replayable(part)
    ]
    if isinstance(loader, DataLoader) and loader.num_workers > 0 and loader.persistent_workers:
        problems.append("persistent_workers=True keeps each worker's random state from epoch to epoch")
    if problems:
        warnings.warn(
            f"checkpoint_dir: fit cannot save the exact place of the {type(loader).__name__} passed as train_data "
            f"({'; '.join(problems)}). A resumed run replays the epoch from the global generators and the generators "
            "among its attributes, which is exact only if it draws from nothing else. For an exact resume pass the "
            "Dataset and batch_size, or a DataLoader with a torch.utils.data sampler (generator=torch.Generator()) "
            "and persistent_workers=False.",
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )


# ---------------------------------------------------------------------------------------------
# Running sums (fit's Tally and log window), which stay on the device between saves


def _sums_state(holder, names: tuple[str, ...]) -> dict:
    values = {name: value.cpu() for name, value in holder.sums.values.items()}  # one synchronisation, at a save
    return {"values": values} | {name: getattr(holder, name) for name in names}


def _load_sums(holder, state: dict, device: torch.device) -> None:
    holder.sums.values = {name: value.to(device) for name, value in state["values"].items()}
    for name, value in state.items():
        if name != "values":
            setattr(holder, name, value)


_TALLY_FIELDS = ("samples", "accuracy", "sequences")
_WINDOW_FIELDS = ("sequences", "micro_batches", "samples", "steps", "lrs")


# ---------------------------------------------------------------------------------------------
# What a resume may change


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings that no schedule changes (weight_decay, momentum, betas, ...)."""
    plain = (int, float, str, bool, tuple, type(None))
    return [
        {key: value if isinstance(value, plain) else repr(value) for key, value in group.items()}
        for group in ({k: v for k, v in g.items() if k not in _SCHEDULE_KEYS} for g in optimizer.param_groups)
    ]


def _changes(saved: dict, now: dict, names) -> list[str]:
    return [f"{name} ({saved.get(name)!r} → {now.get(name)!r})" for name in names if saved.get(name) != now.get(name)]


def _group_changes(saved: list[dict], now: list[dict]) -> list[str]:
    if len(saved) != len(now):
        return [f"the optimizer's parameter groups ({len(saved)} → {len(now)})"]
    changes = {}  # by key: a changed weight_decay is said once, not once per group
    for before, after in zip(saved, now):
        for key in sorted(before.keys() | after.keys()):
            if key not in changes and before.get(key) != after.get(key):
                changes[key] = f"{key} ({before.get(key)!r} → {after.get(key)!r})"
    return list(changes.values())


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # a module's extra state need not be a tensor


def _resized_when_loaded(model: torch.nn.Module) -> set[str]:
    """The buffers of torch's fake-quant modules and observers (quantization-aware training), whose
    load_state_dict resizes them to the saved shape: a model prepared afresh (prepare_qat) holds them at their first
    shape ((0,), or one scale) until its first forward, and is the same model as the one saved."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if isinstance(module, (FakeQuantizeBase, ObserverBase))
        for name, _ in module.named_buffers(recurse=False)
    }


def _check_same_model(saved: dict, model: torch.nn.Module, path: Path) -> None:
    """Refuse, before a tensor is copied, weights whose names, shapes or dtypes differ from the model's."""
    resized, model = _resized_when_loaded(model), model.state_dict()
    differences = [f"{name} is not in the file" for name in model.keys() - saved.keys()]
    differences += [f"{name} is not in this model" for name in saved.keys() - model.keys()]
    differences += [
        f"{name} is {_shape(saved[name])} there, {_shape(tensor)} here"
        for name, tensor in model.items()
        if name in saved and _shape(saved[name]) != _shape(tensor) and name not in resized
    ]
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: it holds another model's weights ({'; '.join(sorted(differences)[:3])}"
            f"{'; ...' if len(differences) > 3 else ''}); pass the model it was trained with, or a new checkpoint_dir."
        )
    dtypes = {  # load_state_dict would cast them without a word: the run would not go on as saved
        name: (saved[name].dtype, tensor.dtype)
        for name, tensor in model.items()
        if torch.is_tensor(tensor) and torch.is_tensor(saved[name]) and saved[name].dtype != tensor.dtype
    }
    if dtypes:
        name, (there, here) = next(iter(dtypes.items()))
        raise CheckpointError(
            f"cannot resume from {path}: its weights are {there} and this model's are {here} ({name}, and "
            f"{len(dtypes) - 1} more); convert the model back (model.to({there})) to resume the run saved there, or "
            "pass a new checkpoint_dir."
        )


_ENTRIES = ("epoch", "step", "position", "plan", "settings", "optimizer_groups", "schedule_start", "model")
_ENTRIES += ("optimizer", "scheduler", "precision", "history", "ranks")  # what fit saves, all read on resume


def _check_entries(state, path: Path) -> None:
    missing = [name for name in _ENTRIES if name not in state] if isinstance(state, dict) else list(_ENTRIES)
    if missing:
        raise CheckpointError(
            f"cannot resume from {path}: it is intact but lacks what fit saves ({', '.join(missing)}), so another "
            "program wrote it (gk.fit's saves hold them all); pass a new checkpoint_dir to start afresh and keep it, "
            "or load what it holds with torch.load."
        )


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters `optimizer` updates, in its order (what its saved state is indexed by)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [names.get(id(parameter), "?") for group in optimizer.param_groups for parameter in group["params"]]


def _check_same_trained(state: dict, model: torch.nn.Module, optimizer, path: Path) -> None:
    """Refuse a resume after parameters were frozen or unfrozen (requires_grad) since the save, naming them."""
    now = _trained(model, optimizer)
    saved = state.get("trained")  # (not in the files of before it was saved: then torch's optimizers' count tells)
    saved_groups = state["optimizer"].get("param_groups", [{"params": now}])  # (gpukit's Muon saves two optimizers)
    saved_count = sum(len(group["params"]) for group in saved_groups)
    if (set(saved) == set(now)) if saved is not None else len(now) == saved_count:
        return  # (the same set in another order: another optimizer's groups, which _check names)
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    if saved is not None:
        dropped = [name for name in saved if name not in now]
        changes = [f"{name} was trained, is {'frozen' if name in frozen else 'left out'} now" for name in dropped]
        changes += [f"{name} is trained now, was not" for name in now if name not in saved]
    else:
        changes = [f"{saved_count} parameters were trained, {len(now)} are now"] + [
            f"{name} is frozen" for name in frozen
        ]
    raise CheckpointError(
        f"cannot resume from {path}: the set of trainable parameters changed since the save ({'; '.join(changes[:4])}"
        f"{'; ...' if len(changes) > 4 else ''}): a layer frozen or unfrozen (requires_grad), so the saved optimizer "
        "state fits other parameters. Set requires_grad as it was to resume that run; or, to train the new set from "
        f"its weights, model.load_state_dict(torch.load({str(path)!r})['model']) and pass a new checkpoint_dir."
    )


def _length_refusal(step: int, saved_total: int | None, total: int | None) -> str:
    if saved_total is not None and step >= saved_total:
        return (
            f"the run saved there is finished after {step} optimizer steps, more than the {total} this call plans; "
            f"pass epochs (or max_steps) that reach past step {step} to train on, or a new checkpoint_dir."
        )
    return (
        f"the run saved there stopped at optimizer step {step} of the {saved_total or 'unbounded'} it planned, and this "
        f"call plans {total or 'no end'} (epochs or max_steps changed). Its schedule spans the planned steps and cannot "
        "be stretched exactly: finish it with the epochs and max_steps it began with, then call again with more epochs "
        "to go on with a new schedule; or pass a new checkpoint_dir."
    )


def _new_schedule(optimizer, peaks: list[float], build_schedule: Callable, steps: int | None):
    """A fresh schedule from each group's peak lr over `steps` (what extending a finished run trains on)."""
    for group, peak in zip(optimizer.param_groups, peaks):
        for key in ("initial_lr", "max_lr", "min_lr"):
            group.pop(key, None)  # the previous schedule's: a new one sets its own
        group["lr"] = peak
    return build_schedule(optimizer, total_steps=steps)
