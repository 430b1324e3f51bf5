"""gk.lr_find's suggestion, on three kinds of model and on curves made to order; and data shorter than the
sweep, read again pass after pass (as fastai's lr_find does). The rest (restoring the model, batch forms,
bad input) is in tests/test_optim.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit as gk
from gpukit.train.lr_finder import _suggest
from tests.helpers import tiny_gpt

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

STEPS = 80  # of the sweep, and of each training run compared


def quadrant_images(count: int = 512) -> TensorDataset:
    """4 classes: which quadrant of a noisy 16×16 image is brighter. A small CNN learns it in tens of steps."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (count,), generator=generator)
    images = torch.randn(count, 3, 16, 16, generator=generator)
    for quadrant in range(4):
        row, column = divmod(quadrant, 2)
        images[labels == quadrant, :, 8 * row : 8 * row + 8, 8 * column : 8 * column + 8] += 1.0
    return TensorDataset(images, labels)


class LSTMClassifier(nn.Module):
    """(B, 12) tokens → 4 classes: how many tokens are small."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.lstm, self.head = nn.Embedding(32, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.embed(tokens))
        return self.head(outputs[:, -1])


def counting_data(count: int = 512) -> TensorDataset:
    tokens = torch.randint(0, 32, (count, 12), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens, ((tokens < 8).sum(1) // 2).clamp(max=3))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return gk.models.fast_cnn(4, num_classes=4)


def case(kind: str, corpus):
    """(build the model, data, optimizer, batch size)."""
    if kind == "cnn":
        return cnn, quadrant_images(), "nesterov", 16
    if kind == "gpt":
        return lambda: tiny_gpt(max_seq_len=16, width=16), corpus[0], "adamw", 8
    return LSTMClassifier, counting_data(), "adamw", 16


@pytest.mark.parametrize("kind", ["cnn", "gpt", "lstm"])
def test_training_at_the_suggestion_beats_training_at_the_start_lr(kind, corpus):
    build, data, optimizer, batch_size = case(kind, corpus)
    result = gk.lr_find(build(), data, optimizer=optimizer, batch_size=batch_size, steps=STEPS, device="cpu")
    assert result.lrs[0] < result.steepest and 10 * result.lrs[0] < result.suggestion < result.lrs[-1]
    final = {}
    for name, lr in (("start_lr", result.lrs[0]), ("suggestion", result.suggestion)):
        history = gk.fit(
            build(),
            data,
            optimizer=optimizer,
            batch_size=batch_size,
            lr=lr,
            max_steps=STEPS,
            log_every=10,
            progress=False,
            device="cpu",
        )
        final[name] = sum(history.losses[-2:]) / 2  # the last 20 steps
    assert final["suggestion"] < 0.85 * final["start_lr"], (result, final)


def made_curve(levels, noise: float = 0.03, start_lr: float = 1e-5, end_lr: float = 10.0):
    """(lrs, losses) of a sweep whose loss at step i is levels[i] plus seeded normal noise."""
    generator = torch.Generator().manual_seed(0)
    count = len(levels)
    lrs = [start_lr * (end_lr / start_lr) ** (i / (count - 1)) for i in range(count)]
    return lrs, [level + noise * torch.randn((), generator=generator).item() for level in levels]


def test_a_flat_noisy_curve_suggests_a_tenth_of_where_the_loss_starts_to_rise():
    """What a ViT gave with AdamW: flat within the noise for decades, then rising. The minimum is wherever the
    noise dipped (the old rule suggested 1.4e-5; its steepest was start_lr in 5 of 8 runs)."""
    levels = [2.3] * 70 + [2.3 * 1.06 ** (i + 1) for i in range(20)]  # rises from step 70
    lrs, losses = made_curve(levels)
    result = _suggest(lrs, losses, "diverged")
    rising = lrs[70]  # 0.52
    assert rising / 15 < result.suggestion < rising / 5, result  # a tenth of where it starts to rise
    assert result.steepest != lrs[0] and result.lowest_lr < result.best_lr
    assert 0.02 < result.noise < 0.045  # the noise put in: 0.03


def test_a_clean_valley_suggests_a_tenth_of_its_bottom_and_the_steepest_descent_lies_on_the_way_down():
    # Falls (fastest at step 40), bottoms out at steps 55-60, then rises.
    levels = [1.0 + 1.5 / (1 + math.exp((i - 40) / 4)) if i < 60 else 1.0 * 1.08 ** (i - 59) for i in range(90)]
    lrs, losses = made_curve(levels, noise=0.01)
    result = _suggest(lrs, losses, "diverged")
    assert lrs[52] / 10 <= result.suggestion <= lrs[62] / 10, result
    assert lrs[36] <= result.steepest <= lrs[44]


class Passes:
    """A re-iterable list of batches that counts how often it was read from the start."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.batches)


def test_data_shorter_than_the_sweep_is_read_again_pass_after_pass():
    data = quadrant_images(5 * 8)
    batches = Passes([(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 40, 8)])
    result = gk.lr_find(cnn(), batches, steps=12, accumulate=2, end_lr=1e-2, device="cpu")
    assert len(result.lrs) == 12 and batches.passes == 5  # 24 micro-batches from 5 a pass
    loader = gk.data.DeviceLoader(gk.data.shapes(48, 0, seed=0)[0], 16, device="cpu")  # 3 batches, reshuffled
    result = gk.lr_find(gk.models.fast_cnn(4), loader, steps=10, end_lr=1e-2, device="cpu")
    assert len(result.lrs) == 10


def test_data_that_cannot_be_read_again_or_is_empty_is_a_clear_error():
    data = quadrant_images(5 * 8)
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 40, 8)]
    with pytest.raises(ValueError, match="generator or iterator can be read only once"):
        gk.lr_find(cnn(), iter(batches), steps=10, device="cpu")
    with pytest.raises(ValueError, match="got no batch"):
        gk.lr_find(cnn(), [], steps=10, device="cpu")
