"""One training step on one batch, for any model and any batch form.

`fit`, `evaluate`, `gk.memory`, `gk.bench`, `gk.distributed.scaling` and the benchmarks all run
this one definition, so what is measured is what is trained. Read in this order:

    batches.py     the batch forms a loader may yield, split into what the model is called with and its target;
    outputs.py     what a model may return: its prediction, its own loss, the losses it names;
    losses.py      the loss of those outputs against the target (yours, a built-in one, or the model's own),
                   and whether accuracy means something for them (the built-in ones: builtin_losses.py);
    train_step.py  TrainStep: forward (under the precision's autocast), backward, and the optimizer step.

Every name is also here, as gk.step.<name>.
"""

from .batches import BATCH_FORMS as BATCH_FORMS  # the forms in words, for messages
from .batches import IGNORE_INDEX, Batch, BatchError, split_batch, to_device
from .builtin_losses import CrossEntropy, cross_entropy, mean_squared_error
from .builtin_losses import as_class_indices as as_class_indices
from .losses import LOSSES, Loss
from .outputs import class_dimension as class_dimension
from .outputs import (
    describe_value,
    is_list_of_dicts,
    loss_parts,
    named_outputs,
    only_losses,
    unpack_outputs,
)
from .train_step import TrainStep, forward_backward, training_mode

__all__ = [
    "IGNORE_INDEX",
    "LOSSES",
    "Batch",
    "BatchError",
    "CrossEntropy",
    "Loss",
    "TrainStep",
    "cross_entropy",
    "describe_value",
    "forward_backward",
    "is_list_of_dicts",
    "loss_parts",
    "mean_squared_error",
    "named_outputs",
    "only_losses",
    "split_batch",
    "to_device",
    "training_mode",
    "unpack_outputs",
]
