"""gk.inference.measure: what it runs (eval mode, no autograd, the layout and precision asked for) and its rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import inference

CPU = torch.device("cpu")


class Recorder(nn.Module):
    """A small CNN that records, for each call, what inference must look like from inside the model."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.calls = []

    def forward(self, images):
        out = self.conv(images)
        self.calls.append(
            {
                "batch": images.shape[0],
                "training": self.training,
                "grad": torch.is_grad_enabled(),
                "inference": torch.is_inference_mode_enabled(),
                "dtype": out.dtype,
                "channels_last": images.is_contiguous(memory_format=torch.channels_last) and images.shape[1] > 1,
            }
        )
        return out.mean((2, 3))


def images(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 3, 8, 8)


def test_each_batch_size_is_timed_in_eval_mode_without_autograd():
    model = Recorder().train()
    rows = inference.measure(model, images, [1, 4], device=CPU, warmup=1, repeats=3)
    assert [(row.variant, row.batch_size) for row in rows] == [("fp32", 1), ("fp32", 4)]
    assert [call["batch"] for call in model.calls] == [1, 4] + [1, 4] * 3  # warm-up, then interleaved repeats
    assert not any(call["training"] or call["grad"] for call in model.calls)
    assert all(call["inference"] and call["dtype"] == torch.float32 for call in model.calls)
    for row in rows:
        assert 0 < row.best <= row.latency and row.throughput == pytest.approx(row.batch_size / row.latency)


def test_the_clock_given_times_every_call():
    """A clock whose readings are 1 s apart: each timed call takes 1 s by it, whatever the work (the default wall
    clock would give milliseconds), so the clock reaches the timing."""
    ticks = iter(range(10**6))
    rows = inference.measure(Recorder(), images, [1, 4], device=CPU, warmup=0, repeats=3, clock=lambda: next(ticks))
    assert [(row.best, row.latency) for row in rows] == [(1, 1), (1, 1)]


def test_precision_and_layout_reach_the_model():
    model = Recorder()
    [row] = inference.measure(model, images, [2], precision="bf16-mixed", channels_last=True, device=CPU, repeats=2)
    assert row.variant == "bf16-mixed+channels_last"
    assert all(call["dtype"] == torch.bfloat16 and call["channels_last"] for call in model.calls)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_a_transformer_on_tokens():
    model = gk.models.gpt(max_seq_len=16, width=32, depth=1, heads=2)
    rows = inference.measure(model, lambda b: torch.randint(0, 256, (b, 16)), [1, 3], device=CPU, repeats=2)
    assert [row.batch_size for row in rows] == [1, 3] and all(row.throughput > 0 for row in rows)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"batch_sizes": []}, "batch_sizes"),
        ({"batch_sizes": [0]}, "batch_sizes"),
        ({"batch_sizes": [2], "compile": True, "warmup": 1}, "warmup >= 2"),
    ],
)
def test_bad_arguments_are_named_before_any_work(arguments, message):
    model = Recorder()
    with pytest.raises(ValueError, match=message):
        inference.measure(model, images, device=CPU, **arguments)
    assert model.calls == []
