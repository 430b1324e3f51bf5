"""A further family end to end: multi-task learning, one shared body and a head per task, with a target per task
(`(x, {"cls": (B,), "reg": (B,)})`) and a loss_fn that returns a dict of named losses ({"cls": …, "reg": …}).

fit minimises the parts' sum and logs each (loss_cls, loss_reg) per step, per epoch and in evaluation, as it does for a
model's own dict of losses; metrics get the target dict whole. Everything runs on the CPU, seeded, on one thread.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk
from tests.helpers import raising_at

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons (conftest.py)

CPU = torch.device("cpu")
FEATURES, WIDTH, CLASSES = 6, 16, 3


class TwoHeads(nn.Module):
    """A shared body (with dropout: a hand loop must draw its masks in fit's order) and two heads: classes, a value."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Dropout(0.1))
        self.cls, self.reg = nn.Linear(WIDTH, CLASSES), nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> dict:  # (B, F) -> {"cls": (B, C), "reg": (B,)}
        hidden = self.body(x)
        return {"cls": self.cls(hidden), "reg": self.reg(hidden).squeeze(-1)}


def multi_task_loss(outputs: dict, target: dict) -> dict:
    return {"cls": F.cross_entropy(outputs["cls"], target["cls"]), "reg": F.mse_loss(outputs["reg"], target["reg"])}


def batches(sizes: list[int], seed: int = 0) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, FEATURES, generator=generator),
            {
                "cls": torch.randint(0, CLASSES, (size,), generator=generator),
                "reg": torch.randn(size, generator=generator),
            },
        )
        for size in sizes
    ]


TRAIN = batches([6] * 6)
SGD = dict(optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.05, momentum=0.9), lr=None)
PLAIN = dict(schedule="constant", warmup=0, progress=False, device=CPU, seed=0, loss_fn=multi_task_loss)


def by_hand(model: nn.Module, data: list, accumulate: int = 1) -> list[dict]:
    """fit's loop written out (seeded as seed=0 seeds): each micro-batch's parts, their sum minimised."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    model.train()
    parts = []
    for number, (x, target) in enumerate(data, 1):
        losses = multi_task_loss(model(x), target)
        loss = losses["cls"] + losses["reg"]
        (loss / accumulate if accumulate > 1 else loss).backward()
        parts.append({name: value.item() for name, value in losses.items()})
        if number % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return parts


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_minimises_the_sum_of_the_parts_as_a_hand_loop_and_logs_each(accumulate):
    model, hand = TwoHeads(), TwoHeads()
    history = gk.fit(model, TRAIN, accumulate=accumulate, log_every=1, **SGD, **PLAIN)
    parts = by_hand(hand, TRAIN, accumulate)
    assert_bit_equal(model, hand)
    assert not torch.equal(model.cls.weight, TwoHeads().cls.weight)  # it trained
    for row, start in zip(history.steps, range(0, len(parts), accumulate), strict=True):
        for name in ("cls", "reg"):  # each part's mean over the step's micro-batches, as the hand loop measured it
            expected = sum(part[name] for part in parts[start : start + accumulate]) / accumulate
            assert row[f"loss_{name}"] == pytest.approx(expected, rel=1e-6)
        assert row["loss"] == pytest.approx(row["loss_cls"] + row["loss_reg"], rel=1e-6)
    epoch = history.epochs[0]
    assert epoch["train_loss_reg"] == pytest.approx(sum(part["reg"] for part in parts) / len(parts), rel=1e-6)
    assert "train_accuracy" not in epoch  # a target per task: accuracy is a metric of yours


def test_evaluate_and_fit_report_each_part_as_a_mean_over_samples():
    model, held_out = TwoHeads(), batches([2, 7], seed=5)
    accuracy = {"cls_accuracy": lambda outputs, target: (outputs["cls"].argmax(-1) == target["cls"]).float().mean()}
    result = gk.evaluate(model, held_out, loss_fn=multi_task_loss, metrics=accuracy, device=CPU)
    model.eval()
    with torch.no_grad():
        parts = [multi_task_loss(model(x), target) for x, target in held_out]
        right = [(model(x)["cls"].argmax(-1) == target["cls"]).float().mean().item() for x, target in held_out]
    by_samples = {name: (2 * parts[0][name].item() + 7 * parts[1][name].item()) / 9 for name in ("cls", "reg")}
    assert abs(by_samples["reg"] - (parts[0]["reg"].item() + parts[1]["reg"].item()) / 2) > 1e-3  # weights differ
    assert result["loss_cls"] == pytest.approx(by_samples["cls"], rel=1e-6)
    assert result["loss_reg"] == pytest.approx(by_samples["reg"], rel=1e-6)
    assert result["loss"] == pytest.approx(by_samples["cls"] + by_samples["reg"], rel=1e-6)
    assert result["cls_accuracy"] == pytest.approx((2 * right[0] + 7 * right[1]) / 9, rel=1e-6)
    history = gk.fit(TwoHeads(), TRAIN, eval_data=held_out, metrics=accuracy, epochs=1, **SGD, **PLAIN)
    assert {"eval_loss_cls", "eval_loss_reg", "eval_cls_accuracy", "train_loss_cls"} <= set(history.epochs[0])


@pytest.mark.parametrize("call", [4, 9])
def test_a_multi_task_run_stopped_midway_resumes_bit_equal(call, tmp_path):
    """Ctrl-C at loss call 4 (epoch 1, after the save at step 2) or 9 (epoch 2), then the same call again."""
    options = dict(SGD, schedule="constant", warmup=0, progress=False, device=CPU, epochs=2, save_every=2, log_every=1)
    straight = TwoHeads()
    straight_history = gk.fit(straight, TRAIN, checkpoint_dir=tmp_path / "a", loss_fn=multi_task_loss, **options)
    with pytest.raises(KeyboardInterrupt):
        gk.fit(
            TwoHeads(),
            TRAIN,
            checkpoint_dir=tmp_path / "b",
            loss_fn=raising_at(call, multi_task_loss, KeyboardInterrupt),
            **options,
        )
    torch.manual_seed(123)  # another process: other generators
    resumed = TwoHeads()
    history = gk.fit(resumed, TRAIN, checkpoint_dir=tmp_path / "b", loss_fn=multi_task_loss, **options)
    assert_bit_equal(straight, resumed)
    assert [row["loss_reg"] for row in history.steps] == [row["loss_reg"] for row in straight_history.steps]


def test_a_part_that_is_no_scalar_is_refused_at_the_first_batch_naming_it():
    def per_example(outputs, target):  # the regression part left unreduced: one loss per example
        return {"cls": F.cross_entropy(outputs["cls"], target["cls"]), "reg": (outputs["reg"] - target["reg"]) ** 2}

    model = TwoHeads()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"returned a dict whose 'reg' is a tensor of shape \(6,\).*one scalar tensor"):
        gk.fit(model, TRAIN, **SGD, **dict(PLAIN, loss_fn=per_example))
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())  # no step taken
