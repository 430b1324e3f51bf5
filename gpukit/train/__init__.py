"""Training: `fit()` and `evaluate()` for any model and batch form, the `History` fit returns,
and resuming from checkpoints. One training step on one batch is defined in gpukit.step."""

from ..runfile import HistoryFileError
from .checkpoint import CheckpointError
from .evaluate import evaluate
from .history import History
from .loop import NonFiniteLossError, as_loader, fit

__all__ = ["CheckpointError", "History", "HistoryFileError", "NonFiniteLossError", "as_loader", "evaluate", "fit"]
