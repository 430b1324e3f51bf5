"""Training: `fit()` and `evaluate()` for any model and batch form, the `History` fit returns,
resuming from checkpoints, saved runs,
and the learning-rate range test `lr_find`. One training step on one batch is defined in gpukit.step."""

from ..files import FolderInUseError
from ..runfile import HistoryFileError
from .checkpoint import CheckpointError
from .checks import NonFiniteInputError
from .evaluation import evaluate
from .history import History
from .loop import NonFiniteLossError, as_loader, fit
from .lr_finder import LRFinderResult, lr_find

__all__ = [
    "CheckpointError",
    "FolderInUseError",
    "History",
    "HistoryFileError",
    "LRFinderResult",
    "NonFiniteInputError",
    "NonFiniteLossError",
    "as_loader",
    "evaluate",
    "fit",
    "lr_find",
]
