"""Running sums over a pass of the data, for `fit`'s epochs and for `evaluate`."""

from __future__ import annotations

import keyword
import numbers
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from .. import distributed
from ..step import Batch, Loss, describe_value, loss_parts, only_losses, unpack_outputs

RESERVED = ("loss", "accuracy", "samples", "tokens", "correct", "scored")  # columns, and the Tally's own sums


def check_metrics(metrics) -> dict[str, Callable]:
    """{name: fn(outputs, target) -> number, or a dict of numbers}: names that make columns, functions that can be
    called."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must be a dict of name → function(outputs, target), got {type(metrics).__name__}; e.g. "
            "metrics={'mae': lambda outputs, target: (outputs - target).abs().mean()}."
        )
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name in RESERVED:
            raise ValueError(
                f"metric name {name!r} cannot be a column: use a Python identifier other than {', '.join(RESERVED)}."
            )
        if not callable(fn):
            raise TypeError(f"metric {name!r} is a {type(fn).__name__}, not a function of (outputs, target).")
    return dict(metrics)


def check_metric_value(name: str, value) -> None:
    """One number per batch, or a dict of numbers, as a metric must return: checked on the first batch, before
    the first optimizer step."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            check_metric_value(f"{name}[{key!r}]", item)
        return
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return
    if value is None:
        got = "None (is its `return` missing?)"
    elif isinstance(value, torch.Tensor):
        got = f"a tensor of shape {tuple(value.shape)}"
    else:
        got = f"a {type(value).__name__}"
    raise ValueError(
        f"metric {name!r} returned {got}; a metric returns one number per batch (a Python number or a one-element "
        "tensor), or a dict of them (a column each), e.g. lambda outputs, target: (outputs - target).abs().mean()."
    )


def _nothing_to_report(outputs) -> str:
    return (
        f"evaluation has nothing to report: the model returned {describe_value(outputs)} in eval mode, which holds "
        "no loss (no 'loss', no dict of losses) and no prediction to score, and no metrics were given. torchvision's "
        "detectors return their detections in eval mode and compute their losses only in training mode: pass "
        "metrics={'name': fn(outputs, targets)}, a number or a dict of numbers per batch (e.g. the share of "
        "images whose best box overlaps a target box)."
    )


def check_shifted_labels(shifted_labels) -> None:
    if shifted_labels is not None and not isinstance(shifted_labels, bool):
        raise TypeError(
            f"shifted_labels must be True (the loss scores labels[:, 1:], as a causal LM that shifts its labels "
            f"does), False (the labels as given) or None (measured), got {shifted_labels!r}."
        )


def decide_shifted_labels(loss: Loss, batch: Batch, outputs, value: torch.Tensor | None) -> bool:
    """Whether tokens are counted from labels[:, 1:] (what a causal LM that shifts its labels scores): measured by
    Loss.shifts_labels. A model's own loss that it cannot tell apart is counted as given, with a warning saying
    how to choose."""
    shifted = loss.shifts_labels(batch, outputs, value)
    if shifted is None:
        warnings.warn(
            "cannot tell which labels the model's own loss scores: it matches neither, or both, of cross-entropy of "
            "its logits against the labels as given and shifted by one (a causal LM's, which scores T - 1 a "
            "sequence). Tokens are counted as given (every label not -100). Pass shifted_labels=True if the model "
            "shifts its labels inside (Hugging Face's causal LMs), shifted_labels=False if not (a token classifier).",
            stacklevel=callers_stacklevel(),
        )
    return bool(shifted)


def callers_stacklevel() -> int:
    """warnings.warn's stacklevel, from the function that warns, of the first frame outside gpukit and torch: the
    line of yours that called evaluate or fit, however deep (torch.no_grad's wrapper, fit's parts) it was reached."""
    inside = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


class RunningSums:
    """Named sums kept on the device in float64: adding never waits for the GPU, `read()` waits once,
    and `over_ranks()` adds them up across a distributed job in one all-reduce. A name is added the first
    time a value is.

    `defer` keeps a tensor (and the number it is multiplied by) to be added later, with no kernel now: the
    per-step sums of fit cost no launches per step. They are added when the sums are looked at (`values`) or
    when 32 wait, in the order they came, by a float64 cumsum (sequential on a CPU, so the same bits as adding
    one at a time: fit's History did not change by a bit)."""

    deferred_limit = 32  # tensors kept per name before they are added: bounds the memory they hold

    def __init__(self, device: torch.device, names, before_reading: Callable[[], None] | None = None):
        self.zero, *zeros = torch.zeros(len(names) + 1, device=device, dtype=torch.float64).unbind()  # one kernel
        self._values = dict(zip(names, zeros))
        self.pending: dict[str, list[tuple[torch.Tensor, int]]] = {}
        self.before_reading = before_reading  # adds what its owner holds back (Tally's held predictions)

    @property
    def values(self) -> dict[str, torch.Tensor]:
        if self.before_reading is not None:
            self.before_reading()
        for name in list(self.pending):
            self._settle(name)
        return self._values

    @values.setter
    def values(self, values: dict[str, torch.Tensor]) -> None:
        self._values, self.pending = values, {}

    def add(self, name: str, value) -> None:
        if name in self.pending:
            self._settle(name)  # keep the order of addition
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).to(torch.float64)
        if name not in self._values:
            self._values[name] = self.zero.clone()
        self._values[name] += value

    def defer(self, name: str, value: torch.Tensor, times: int = 1) -> None:
        """Add `value * times` (a 0-d tensor; the product in its own dtype, as `add` of it would) later."""
        waiting = self.pending.setdefault(name, [])
        waiting.append((value.detach() if value.requires_grad else value, times))
        if len(waiting) >= self.deferred_limit:
            self._settle(name)

    def _settle(self, name: str) -> None:
        waiting = self.pending.pop(name)
        if len({(value.dtype, value.device) for value, _ in waiting}) > 1:  # cannot stack: one at a time
            for value, times in waiting:
                self.add(name, value * times if times != 1 else value)
            return
        if len({times for _, times in waiting}) == 1:
            stacked = torch.stack([value.reshape(()) for value, _ in waiting])
            stacked = stacked * waiting[0][1] if waiting[0][1] != 1 else stacked
        else:  # a last, smaller batch: each product as `add` would have made it
            stacked = torch.stack([(value * times).reshape(()) for value, times in waiting])
        total = self._values.get(name, self.zero).reshape(1)
        self._values[name] = torch.cat([total, stacked.to(torch.float64)]).cumsum(0)[-1]

    def over_ranks(self, *counts: int, names_may_differ: bool = False) -> tuple[int, ...]:
        """Sum every value, and the host-side `counts` given, over all ranks; returns the counts' sums.
        `names_may_differ`: a rank may not have seen every name (no batch at all): agree on them first."""
        values = self.values  # (looked at once: each look adds what waits)
        if names_may_differ:
            names = distributed.names_over_ranks(list(values))
            values = {name: values.get(name, self.zero.clone()) for name in names}
        summed = distributed.sum_over_ranks(*values.values(), *counts)
        self.values = dict(zip(values, summed[: len(values)]))
        return tuple(summed[len(values) :])

    def read(self) -> dict[str, float]:
        values = self.values
        return dict(zip(values, torch.stack(list(values.values())).tolist()))


class Tally:
    """Loss, accuracy, metrics and tokens over a pass of the data (`fit`'s epochs, `evaluate`).

    Tokens are the target's not equal to -100, or of labels[:, 1:] where the loss scores the labels shifted (a causal
    LM's own loss, Hugging Face's: `shifted_labels`, measured at the first batch where not given; see
    Loss.shifts_labels).

    The loss, each of the model's losses (a dict of scalars: gpukit.step.loss_parts) and each metric are
    averaged over samples, weighted by batch size; accuracy is correct over scored targets (token accuracy
    for sequences, targets equal to -100 not scored). Whether accuracy applies is decided at the first batch
    (Loss.tracks_accuracy). Metrics get the outputs as the model returned them (no gradients are recorded);
    a metric that returns a dict gives a column per key, named `<metric>_<key>`. Outputs that are only losses
    (a detector in training mode) hold nothing for a metric to measure: metrics skip them, so a detector's
    metrics are columns of its evaluation alone. The loss is None where there
    is none to compute (a detector's detections in eval mode): then there is no loss column, and metrics
    must be given.
    """

    held_bytes_limit = 4 << 20  # predictions held before their accuracy is counted, in bytes (4 MiB)

    def __init__(
        self,
        device: torch.device,
        loss: Loss,
        metrics: dict[str, Callable],
        hold_predictions: bool = False,
        shifted_labels: bool | None = None,
    ):
        self.loss = loss
        self.metrics = metrics
        self.accuracy: bool | None = None
        self.samples = 0
        self.sequences = False  # whether tokens were counted (sequence data)
        # "loss", parts, metrics: when first seen
        self.sums = RunningSums(device, ["correct", "scored", "tokens"], before_reading=self._count_held)
        self.hold_predictions = hold_predictions  # see predictions_can_wait
        # (prediction, target, target._version) of batches not yet counted
        self.held: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.uncounted = 0  # batches left out of the accuracy: their targets changed in place before being counted
        self.held_bytes = 0
        self.shifted_labels = shifted_labels  # tokens from labels[:, 1:]; None: decided at the first sequence batch

    def add(self, batch: Batch, loss: torch.Tensor | None, outputs, parts: dict | None = None) -> torch.Tensor | None:
        """One batch: its loss and the loss's named parts (Loss.with_parts; None: the model's own, read from the
        outputs), and what the model returned, as it returned it (metrics get that). Returns the batch's scored tokens
        (a 0-d tensor, for sequence data; else None), counted as `shifted_labels` says."""
        first = self.accuracy is None
        if first:
            self.accuracy = self.loss.tracks_accuracy(batch, outputs)
            # An inference tensor (made under torch.inference_mode) keeps no count of its writes to watch: counted at once.
            self.hold_predictions = self.hold_predictions and self.accuracy and not batch.target.is_inference()
            if loss is None and not self.metrics:
                raise ValueError(_nothing_to_report(outputs))
        size = batch.size
        self.samples += size
        if loss is not None:
            self.sums.defer("loss", loss, size)
        alone = type(outputs) is torch.Tensor  # the prediction alone: no losses of the model's own, nothing to unpack
        for name, part in (parts if parts is not None else {} if alone else loss_parts(outputs)).items():
            self.sums.defer(name, part, size)
        if self.accuracy:
            self._hold((outputs if alone else unpack_outputs(outputs)[0]).detach(), batch.target)
        tokens = None
        if batch.is_sequence:
            self.sequences = True
            if self.shifted_labels is None:
                self.shifted_labels = decide_shifted_labels(self.loss, batch, outputs, loss)
            tokens = batch.count_tokens(self.shifted_labels)
            self.sums.defer("tokens", tokens)
        if not self.metrics or only_losses(outputs):
            return tokens  # (a detector's training outputs: its losses, columns above, and no prediction to measure)
        with torch.no_grad():
            for name, fn in self.metrics.items():
                value = fn(outputs, batch.target)
                if first:
                    check_metric_value(name, value)
                values = {f"{name}_{key}": item for key, item in value.items()} if isinstance(value, Mapping) else {}
                for column, item in (values or {name: value}).items():
                    self.sums.add(column, item * size)
        return tokens

    def _hold(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        """Count a batch's correct predictions later, with the next ones': Loss.correct's ten small kernels once
        per 32 batches (or 4 MiB of predictions) instead of once per batch, where `hold_predictions` allows.
        The target's `_version` (its in-place writes) is kept with it: a data pipeline that writes the next batch
        into the same tensors changes a held target, and is caught at the next batch (the last held changed, or
        the first: a ring of buffers) and when counted (_count_held)."""
        held = self.held
        if held and (held[-1][2] != held[-1][1]._version or held[0][2] != held[0][1]._version):
            self._count_held()  # (which stops holding: _targets_changed)
        if not self.hold_predictions:
            self.held.append((prediction, target, None))
            return self._count_held()
        self.held.append((prediction, target, target._version))
        self.held_bytes += prediction.untyped_storage().nbytes()  # a view keeps its whole storage alive
        if len(self.held) >= RunningSums.deferred_limit or self.held_bytes >= self.held_bytes_limit:
            self._count_held()

    def _count_held(self) -> None:
        """Add the held batches' correct and scored predictions to the sums: in one go where they have their
        classes last in the same number, dtype and device ((B, C), (B, T, V): concatenated as (N, C)), else one
        by one. Counts are integers, so the sums are the same bits either way. A batch whose target was changed
        in place since it was held is left out (its values are gone), said once, and batches are counted at once
        from then on."""
        held, self.held, self.held_bytes = self.held, [], 0
        intact = [(p, t) for p, t, version in held if version is None or t._version == version]
        if len(intact) < len(held):
            self._targets_changed(len(held) - len(intact))
        held = intact
        kinds = {(p.shape[-1], p.dtype, p.device, p.shape[:-1] == t.shape) for p, t in held}  # classes last?
        if len(held) > 1 and len(kinds) == 1 and next(iter(kinds))[-1]:
            predictions = torch.cat([prediction.reshape(-1, prediction.shape[-1]) for prediction, _ in held])
            held = [(predictions, torch.cat([target.reshape(-1) for _, target in held]))]
        for prediction, target in held:
            correct, scored = self.loss.correct(prediction, target)
            self.sums.defer("correct", correct)
            self.sums.defer("scored", scored)

    def _targets_changed(self, batches: int) -> None:
        self.hold_predictions = False
        self.uncounted += batches
        warnings.warn(
            f"the data changed the target tensor of {batches} batch(es) in place after their step (a loader that "
            "writes each batch into the same tensors?), before their accuracy was counted: those batches are left "
            "out of the accuracy, and from now on each batch's accuracy is counted at its step. Yield new tensors "
            "per batch (or a clone) to have every batch counted.",
            stacklevel=callers_stacklevel(),
        )

    def over_ranks(self) -> None:
        """Add up every rank's sums and samples (one all-reduce, after agreeing on the names of the sums). Whether
        accuracy applies and whether tokens were counted travel with them: a rank that saw no batch learns them
        from the others, and every rank reports the same columns."""
        self.samples, self.accuracy, self.sequences = self.sums.over_ranks(
            self.samples, bool(self.accuracy), self.sequences, names_may_differ=True
        )

    def read(self, prefix: str = "", tokens: bool = False) -> dict:
        """{prefix + "loss" (where there is one), prefix + "accuracy" (if it applies), prefix + each of the model's
        losses and each metric, and with `tokens` the scored tokens of sequence data}: one synchronisation."""
        values = self.sums.read()
        samples = max(self.samples, 1)
        row = {f"{prefix}loss": values["loss"] / samples} if "loss" in values else {}
        if self.accuracy:
            row[f"{prefix}accuracy"] = values["correct"] / values["scored"] if values["scored"] else None
        counts = ("loss", "correct", "scored", "tokens")
        row |= {f"{prefix}{name}": value / samples for name, value in values.items() if name not in counts}
        if tokens and self.sequences:
            row[f"{prefix}tokens"] = int(values["tokens"])
        return row


def predictions_can_wait(model: nn.Module, device: torch.device, compile=False) -> bool:
    """Whether a batch's prediction may be held past the model's next call (its accuracy counted later, with the
    next batches': Tally's hold_predictions). Not where a CUDA graph may replay: torch.compile's
    mode="reduce-overhead" writes the next call's outputs over the last ones. So: on a CPU always; on a GPU with
    fit's compile off, True, "whole" or "regional" (torch.compile's default mode), and neither a model compiled by
    you before (fit cannot tell how) nor CUDA graphs switched on for every compile (torch._inductor.config)."""
    if device.type == "cpu":
        return True
    if compile not in (False, True, "whole", "regional"):
        return False
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    for module in model.modules() if dynamo is not None else ():
        if isinstance(module, dynamo.OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None:
            return False
    inductor = sys.modules.get("torch._inductor.config")
    return not (inductor is not None and inductor.triton.cudagraphs)
