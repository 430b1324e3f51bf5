"""What a training run measured: `History`."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import runfile
from ..deprecation import renamed_attribute
from ..files import write_atomic
from ..plots import plot_history
from ..report import Table


@dataclass
class History:
    """What a run measured.

    steps:  one row per logged window of `log_every` optimizer steps: step (the last in the
            window), epoch, loss (mean over the window), each of the model's own losses where it
            returns a dict of them (a detector's loss_classifier, loss_box_reg, …: their sum is the
            loss), lr (what the window's last step trained with, read before the schedule moved on; the first
            parameter group's; a History saved by an earlier gpukit holds the next step's there) and lr_group1,
            lr_group2, … (each other group's) where the groups' lrs differ, step_time (s, mean over the window),
            samples_per_second (all ranks), and tokens_per_second for token sequences, (B, T)
            integer targets (scored target tokens; a segmentation's (B, H, W) pixels are not tokens:
            its samples are images, counted by samples_per_second).
    epochs: one row per epoch: epoch, train_loss, then train_accuracy where accuracy means
            something (integer targets scored with cross-entropy), train_<loss part> for each of the
            model's own losses, train_<name> for each of your metrics (a metric returning a dict:
            train_<name>_<key>); the same with eval_ when there is held-out data (a detector in eval
            mode computes no loss: no eval_loss, and its metrics are eval_ columns alone); peak_memory (bytes allocated
            on a CUDA device; None where not measured) and seconds (training only); with
            fit(monitor=True), what was measured of energy_j, joules_per_sample, co2_grams,
            mean_power_w, mean_utilization (%) and throttle_reasons.
    A column that does not apply to the run is absent, never 0.
    micro_batch_size: samples per forward and backward on one rank (fit's batch_size, or your loader's).
    global_batch_size: samples per optimizer step, all ranks together: micro_batch_size × accumulate ×
            ranks (`batch_size` before: deprecated, it read as the micro-batch but held this).
    sample_name: what one sample is ("image", "sequence" or "sample"), read from the first batch.
    shifted_labels: for token sequences, whether tokens were counted from labels[:, 1:] (True: the loss scores the
            labels shifted by one, as a causal LM's own loss does, T - 1 a sequence) or as given (False); None for
            other data. Measured at the first batch unless fit(shifted_labels=…) said it.
    environment: what the run ran on, recorded by fit: device_name, profile, python, torch, cuda,
            gpukit and git_commit (None outside a git checkout).

    `save(path)` / `History.load(path)` keep a run in a JSON file; `to_csv(path)` exports a table.
    """

    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    precision: str = "fp32"
    device: str = "cpu"
    micro_batch_size: int = 0  # samples per forward and backward on one rank
    global_batch_size: int = 0  # samples per optimizer step: micro_batch_size × accumulate × ranks
    sample_name: str = "sample"
    shifted_labels: bool | None = None  # token sequences: tokens counted from labels[:, 1:] (a causal LM's own loss)
    skipped_steps: int = 0  # fp16 steps skipped by the loss scaler
    seconds: float = 0.0  # wall time of the whole fit call (every call of a resumed run): checks, building, evaluation
    environment: dict = field(default_factory=dict)
    monitor: list[dict] = field(default_factory=list)  # fit(monitor=True): GPU samples (see gk.hardware.Monitor)

    batch_size = renamed_attribute(
        "History.batch_size", "global_batch_size", "micro_batch_size is the batch_size passed to fit"
    )

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.steps]

    def final(self, column: str):
        """The last epoch's value of a column (e.g. "eval_loss", "train_mae"), or None."""
        return self.epochs[-1].get(column) if self.epochs else None

    @property
    def final_eval_accuracy(self) -> float | None:
        return self.final("eval_accuracy")

    @property
    def final_train_accuracy(self) -> float | None:
        return self.final("train_accuracy")

    @property
    def final_eval_loss(self) -> float | None:
        return self.final("eval_loss")

    @property
    def metric_names(self) -> list[str]:
        """Columns of the epoch rows that hold a measured quantity (loss, accuracy, your metrics)."""
        names = dict.fromkeys(key for row in self.epochs for key in row)
        return [name for name in names if name.startswith(("train_", "eval_"))]

    def steady_rows(self) -> list[dict]:
        """Logged windows after the first (which holds warm-up, compilation, cuDNN autotuning)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    def _steady_median(self, column: str) -> float | None:
        values = [row[column] for row in self.steady_rows() if row.get(column) is not None]
        return _median(values) if values else None

    @property
    def step_time(self) -> float:
        """Median seconds per optimizer step in steady state."""
        return _median([row["step_time"] for row in self.steady_rows()])

    @property
    def samples_per_second(self) -> float:
        """Median training throughput in steady state (samples/s, all ranks)."""
        return _median([row["samples_per_second"] for row in self.steady_rows()])

    @property
    def tokens_per_second(self) -> float | None:
        """Median throughput in scored target tokens/s for token sequences ((B, T) integer targets); None otherwise."""
        return self._steady_median("tokens_per_second")

    @property
    def images_per_second(self) -> float | None:
        """samples_per_second when the samples are images; None for other data."""
        return self.samples_per_second if self.sample_name == "image" else None

    @property
    def peak_memory(self) -> int | None:
        values = [row["peak_memory"] for row in self.epochs if row.get("peak_memory") is not None]
        return max(values) if values else None

    def summary(self) -> dict:
        summary = {
            "precision": self.precision,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
        }
        summary |= {name: self.final(name) for name in self.metric_names}
        # Throughput in the data's own unit: images_per_second for images, tokens_per_second too for text.
        summary |= {f"{self.sample_name}s_per_second": self.samples_per_second, "step_time_ms": self.step_time * 1e3}
        if self.tokens_per_second is not None:
            summary["tokens_per_second"] = self.tokens_per_second
        return summary | {
            "peak_memory_MiB": None if self.peak_memory is None else self.peak_memory / 2**20,
            "skipped_steps": self.skipped_steps,
            "seconds": self.seconds,
        }

    def table(self):

        return Table(
            self.epochs,
            title=f"{self.precision}, micro-batch {self.micro_batch_size}, {self.global_batch_size} samples per "
            f"optimizer step, on {self.device}",
        )

    def save(self, path: str | Path) -> Path:
        """Write this History to a JSON file (format in gpukit.runfile), atomically; the folder is created.

        Every column of steps and epochs comes back exactly from `History.load`. An existing saved
        History at `path` is replaced; any other file there is refused and left as it was.
        """
        history = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        environment = {"device": history.pop("device"), "precision": history.pop("precision")}
        # A History not made by fit has no environment: record this process's (without a device name).
        environment |= history.pop("environment") or runfile.run_environment(None)
        return runfile.write(path, environment, self.summary(), history)

    @classmethod
    def load(cls, path: str | Path) -> History:
        """The History a `save` wrote (HistoryFileError for a file that is not one, or is from a newer gpukit)."""
        record = runfile.read(path)
        environment = dict(record["environment"])
        known = {f.name for f in dataclasses.fields(cls)}
        # Fields this gpukit does not know (from a later gpukit of the same format) are left out.
        fields = {name: value for name, value in record["history"].items() if name in known}
        if "batch_size" in record["history"]:  # written before the name said what it holds
            fields.setdefault("global_batch_size", record["history"]["batch_size"])
        for name in ("device", "precision"):
            if name in environment:
                fields[name] = environment.pop(name)
        return cls(**fields, environment=environment)

    def to_csv(self, path: str | Path, rows: str = "epochs") -> Path:
        """Write one table as CSV, atomically: rows="epochs" (one row per epoch) or "steps" (one per
        logged window). Columns are the union of the rows' keys; an absent or None value is an empty cell.
        Call it twice for both tables (e.g. run_epochs.csv and run_steps.csv)."""
        if rows not in ("epochs", "steps"):
            raise ValueError(f"rows={rows!r}: to_csv writes rows='epochs' or rows='steps', one table per file.")
        table = self.epochs if rows == "epochs" else self.steps
        columns = list(dict.fromkeys(key for row in table for key in row))
        text = io.StringIO()
        writer = csv.DictWriter(text, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)  # floats as repr(): float(cell) gives back the same number
        path = Path(path)
        write_atomic(path, text.getvalue().encode("utf-8"))
        return path

    def plot(self, **kwargs):

        return plot_history(self, **kwargs)


def _median(values: list[float]) -> float:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    if not values:
        return float("nan")
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
