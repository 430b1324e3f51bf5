"""Training: `fit()` and `evaluate()` for any model and batch form, the `History` fit returns, fit's option groups
(ModelTransforms, Saving, Reporting), resuming from checkpoints, saved runs, and the learning-rate range test `lr_find`.
One training step on one batch is defined in gpukit.step; loop.py's docstring gives the reading order of fit."""

from ..files import FolderInUseError
from ..runfile import HistoryFileError
from .checkpoint import CheckpointError
from .checks import NonFiniteInputError, NonFiniteLossError
from .data import as_loader
from .evaluation import evaluate
from .history import History
from .loop import fit
from .lr_finder import LRFinderResult, lr_find
from .options import ModelTransforms, Reporting, Saving

__all__ = [
    "CheckpointError",
    "FolderInUseError",
    "History",
    "HistoryFileError",
    "LRFinderResult",
    "ModelTransforms",
    "NonFiniteInputError",
    "NonFiniteLossError",
    "Reporting",
    "Saving",
    "as_loader",
    "evaluate",
    "fit",
    "lr_find",
]
