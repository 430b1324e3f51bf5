"""After fit under DDP every rank holds the same buffers (BatchNorm's running statistics) and reports the same
held-out metrics, those of the whole held-out data: real torch.distributed, 2 CPU processes over gloo, one launch.

Two models with buffers: the kit's CNN (BatchNorm2d, on images through the DeviceLoader) and an MLP with
BatchNorm1d and a registered buffer of its own (on a TensorDataset, through a DataLoader with a
DistributedSampler). Without a broadcast the ranks' buffers differ after training: each rank's last forward
updated them with its own half of the batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit import distributed

pytestmark = pytest.mark.timeout(300)

RUN = dict(epochs=2, max_steps=6, lr=0.05, batch_size=16, progress=False, log_every=2, seed=1, device="cpu")


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return gk.models.fast_cnn(4)


class TabularNet(nn.Module):
    """BatchNorm1d, and a buffer of its own: a running mean of the inputs, updated in training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
        self.register_buffer("input_mean", torch.zeros(12))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.input_mean.mul_(0.9).add_(features.mean(0), alpha=0.1)
        return self.layers(features - self.input_mean)


def tabular(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, 12, generator=generator) * 2 + 1
    return TensorDataset(features, (features[:, :3].sum(1) > 3).long() + (features[:, 3] > 1).long())


def held_out_tabular() -> DataLoader:
    """7 batches: rank 0 evaluates 4, rank 1 evaluates 3 (the CNN's 128 held-out images are one batch of
    evaluate's 512: rank 1 evaluates none)."""
    return DataLoader(tabular(101, 2), batch_size=16)


def worker(images, held_out_images):
    distributed.setup()
    results = {}
    for name, model, train, held_out in (
        ("cnn", cnn(), images, held_out_images),
        ("tabular", TabularNet(), tabular(400, 1), held_out_tabular()),
    ):
        history = gk.fit(model, train, eval_data=held_out, **RUN)
        results[name] = {"state": model.state_dict(), "epochs": history.epochs}
    distributed.cleanup()
    return results


@pytest.fixture(scope="module")
def ranks(small_data):
    train, test = small_data
    return gk.distributed.launch(worker, 2, train, test, backend="gloo", timeout=240)


@pytest.mark.parametrize("name", ["cnn", "tabular"])
def test_every_rank_ends_with_rank_0s_buffers_and_reports_the_same_metrics(ranks, name):
    zero, one = ranks[0][name], ranks[1][name]
    buffers = [key for key in zero["state"] if "running" in key or key == "input_mean"]
    assert buffers, zero["state"].keys()
    for key, value in zero["state"].items():  # parameters (DDP) and buffers (the broadcast) alike
        assert torch.equal(value, one["state"][key]), key
    measured = [[{k: v for k, v in row.items() if k != "seconds"} for row in rank["epochs"]] for rank in (zero, one)]
    assert measured[0] == measured[1]  # every measured column of every epoch: eval_loss, eval_accuracy, train_…
    assert {"eval_loss", "eval_accuracy"} <= zero["epochs"][-1].keys()


@pytest.mark.parametrize("name", ["cnn", "tabular"])
def test_the_reported_metrics_are_those_of_the_whole_held_out_data(ranks, small_data, name):
    model = cnn() if name == "cnn" else TabularNet()
    model.load_state_dict(ranks[0][name]["state"])
    held_out = small_data[1] if name == "cnn" else held_out_tabular()
    expected = gk.evaluate(model, held_out, device="cpu")  # one process, every held-out sample
    row = ranks[0][name]["epochs"][-1]
    assert math.isclose(row["eval_loss"], expected["loss"], rel_tol=1e-6)  # float32 forwards on other threads
    assert row["eval_accuracy"] == expected["accuracy"]
