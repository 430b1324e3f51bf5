"""The log window: what fit sums over the optimizer steps between two History rows, kept on the device, and the
row it writes every `log_every` steps (one host-device synchronisation each)."""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from .. import distributed
from ..step import Batch
from .batch_checks import check_finite_inputs, earlier_problem
from .checks import NonFiniteLossError
from .tally import RunningSums


class LogWindow:
    """Sums over the optimizer steps between two log points, kept on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = RunningSums(self.device, ["loss", "tokens"])
        self.sequences = False
        self.micro_batches = self.samples = self.steps = 0
        self.lrs: list[float] = []  # each parameter group's lr that the window's last step trained with
        self.started = time.perf_counter()

    def add(self, batch: Batch, loss: torch.Tensor, parts: dict[str, torch.Tensor], tokens: torch.Tensor | None):
        """One micro-batch's loss, and the model's own losses when it returns a dict of them (a column each);
        for sequence data its scored tokens (Tally.add's count: from labels[:, 1:] where the loss shifts them)."""
        self.sums.defer("loss", loss)  # no kernel now: added when the row is read (RunningSums.defer)
        for name, part in parts.items():
            self.sums.defer(name, part)
        self.micro_batches += 1
        self.samples += batch.size
        if tokens is not None:
            self.sequences = True
            self.sums.defer("tokens", tokens)

    def row(self, step: int, epoch: int, lrs: list[float], stop_asked: bool = False) -> dict:
        """One History.steps row: one synchronisation (and in a distributed job one all-reduce). `stop_asked`: whether
        SIGTERM asked this rank to stop; the ranks asked, summed in the same all-reduce, are `ranks_asked` after."""
        (self.ranks_asked,) = self.sums.over_ranks(int(stop_asked))  # every rank learns it at the same log step
        sums, ranks = self.sums.read(), distributed.world_size()
        elapsed = time.perf_counter() - self.started  # after the synchronisation: the GPU's work is done
        mean = {name: value / (ranks * self.micro_batches) for name, value in sums.items() if name != "tokens"}
        row = {
            "step": step,
            "epoch": epoch,
            **mean,  # the loss, then each of the model's own losses (a dict of them)
            **lr_columns(lrs),
            "step_time": elapsed / self.steps,
            "samples_per_second": self.samples * ranks / elapsed,
        }
        if self.sequences:
            row["tokens_per_second"] = sums["tokens"] / elapsed
        return row


def lr_columns(lrs: list[float]) -> dict[str, float]:
    """lr (the first parameter group's), then lr_group1, lr_group2, ... for the others where the groups' lrs differ."""
    columns = {"lr": lrs[0]}
    if len(set(lrs)) > 1:
        columns |= {f"lr_group{index}": lr for index, lr in enumerate(lrs[1:], start=1)}
    return columns


def write_row(run, window: LogWindow, epoch: int, batch: Batch | None = None) -> None:
    """The window's row into `run`'s History (fit's Run), the TensorBoard log and the bar, then a new window. A loss that is no longer
    finite stops the run here, named as a data problem where the last batch shows one."""
    # A window resumed from a file saved before windows kept their lrs has none: the optimizer's now is the nearest.
    lrs = window.lrs or [group["lr"] for group in run.step.optimizer.param_groups]
    row = window.row(run.step_index, epoch + 1, lrs, run.stop.asked)
    run.stop_agreed = window.ranks_asked > 0  # a SIGTERM on any rank: every rank saves after this step and stops
    if not math.isfinite(row["loss"]):
        earlier = partial(earlier_problem, run, epoch, batch)  # the epoch read again, if the last batch is finite
        check_finite_inputs(batch, run.step_index, epoch, run.loss.ignore_index, earlier)  # named as a data problem
        raise NonFiniteLossError(
            f"the loss became {row['loss']} between optimizer steps {run.step_index - window.steps + 1} and "
            f"{run.step_index} (epoch {epoch + 1}, precision={run.precision.name}, peak lr={run.peak_lr:g}). Try a "
            "lower lr, more warm-up, gradient clipping (clip=1.0), or bf16-mixed instead of fp16-mixed (or loss "
            "scaling if you scale by hand). The last batch read holds no NaN or inf and scores at least one "
            "target, nor does an earlier one of the epoch, as far as the data could be read again."
            + (f" Nothing non-finite was saved: {run.checkpoint.last_good_save()}." if run.checkpoint else "")
        )
    run.history.steps.append(row)
    run.board.add_step(row)
    run.bar.update(window.steps, row, run.history)
    window.reset()
