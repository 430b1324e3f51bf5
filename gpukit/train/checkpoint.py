"""Save a run after every epoch and resume it: `fit(checkpoint_dir=...)`."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .. import distributed
from ..files import save_atomic


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed: damaged, or written by a different run."""


class Checkpointer:
    """Saves `last.pt` in a folder after every epoch (atomically) and resumes from it."""

    def __init__(self, directory: str | Path, plan: dict):
        self.path = Path(directory) / "last.pt"
        self.plan = plan  # what the run looks like: a resume must plan the same steps

    def save(self, epoch: int, step: int, model, optimizer, scheduler, precision, history) -> None:
        save_atomic(
            {
                "epoch": epoch,
                "step": step,
                "plan": self.plan,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "precision": precision.state_dict(),
                "history": {
                    "steps": history.steps,
                    "epochs": history.epochs,
                    "seconds": history.seconds,
                    "batch_size": history.global_batch_size,
                    "micro_batch_size": history.micro_batch_size,
                    "sample_name": history.sample_name,
                },
                "rng": torch.get_rng_state(),
            },
            self.path,
        )

    def resume(self, model, optimizer, scheduler, precision, history) -> tuple[int, int]:
        """(epoch, optimizer step) to continue from: (0, 0) without a checkpoint."""
        if distributed.is_sharded(model):
            raise ValueError(
                "checkpoint_dir does not support FSDP2-sharded models; save those with torch.distributed.checkpoint."
            )
        if not self.path.exists():
            return 0, 0
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            if state["plan"] != self.plan:
                raise ValueError(
                    f"it was written by a run planned as {state['plan']}, but this call plans {self.plan}; "
                    "resume with the same epochs, batch_size, accumulate, max_steps and number of processes"
                )
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            precision.load_state_dict(state["precision"])
            saved = state["history"]
            history.steps, history.epochs, history.seconds = saved["steps"], saved["epochs"], saved["seconds"]
            history.global_batch_size, history.sample_name = saved["batch_size"], saved["sample_name"]
            history.micro_batch_size = saved.get("micro_batch_size", 0)  # absent from older checkpoints
            torch.set_rng_state(state["rng"])
            return state["epoch"], state["step"]
        except (RuntimeError, KeyError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise CheckpointError(
                f"cannot resume from {self.path}: {error}. It was written by another model, optimizer or "
                "precision, or is damaged; pass a new checkpoint_dir, or delete the file to start afresh."
            ) from error
