"""fit(seed=) seeds what fit draws: the data order and torch's global generator (dropout). Two fits from the
same weights with the same seed end equal, whatever the generator's state before; another seed differs. Tried
on an MLP with dropout over a TensorDataset (fit's DataLoader) and a GPT with dropout over byte tokens (the
TextLoader); and the CLI's --seed, which also seeds the initial weights and the augmentation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit as gk
from gpukit.commands.cli import build_parser, train_main
from tests.helpers import tiny_gpt

pytestmark = pytest.mark.timeout(300)


def mlp_with_dropout() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def tabular() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(96, 10, generator=generator)
    return TensorDataset(features, (features[:, 0] > 0).long() + (features[:, 1] > 0).long())


def fitted(model: nn.Module, data, seed: int, **options) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)  # the same starting weights every time
    torch.rand(7)  # a different global generator state before each fit: fit must not depend on it
    gk.fit(model, data, seed=seed, epochs=2, lr=0.05, progress=False, device="cpu", **options)
    return model.state_dict()


def assert_equal_states(a: dict, b: dict) -> None:
    assert all(torch.equal(a[name], b[name]) for name in a)


def assert_different_states(a: dict, b: dict) -> None:
    assert any(not torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_two_fits_with_dropout_and_the_same_seed_end_equal_and_other_seeds_differ(kind, corpus):
    if kind == "mlp":
        model, data, options = mlp_with_dropout(), tabular(), {"batch_size": 16}
    else:
        model, data, options = tiny_gpt(max_seq_len=16, width=16, dropout=0.2), corpus[0], {"batch_size": 8}
        options["max_steps"] = 6
    first = fitted(model, data, 0, **options)
    assert_equal_states(first, fitted(model, data, 0, **options))
    assert_different_states(first, fitted(model, data, 1, **options))


def test_dropout_alone_is_seeded():
    """Full-batch training with a fixed order: only dropout draws, so only the global generator's seed counts."""
    model, (features, labels) = mlp_with_dropout(), tabular().tensors
    batches = [(features, labels)] * 3  # a list: fit's seed cannot reorder it
    first = fitted(model, batches, 0)
    assert_equal_states(first, fitted(model, batches, 0))
    assert_different_states(first, fitted(model, batches, 1))


def test_fit_refuses_a_seed_that_is_not_an_integer():
    with pytest.raises(ValueError, match=r"seed must be an integer in 0\.\.4294967295 .*got 'zero'"):
        gk.fit(mlp_with_dropout(), tabular(), batch_size=16, seed="zero", device="cpu", progress=False)


def cli_losses(seed: int, monkeypatch) -> list[float]:
    monkeypatch.setenv("GPUKIT_PROFILE", "tiny")
    sizes = ["--train-size", "128", "--test-size", "32", "--width", "4", "--epochs", "1", "--batch-size", "32"]
    arguments = build_parser().parse_args(["train", *sizes, "--augment", "--device", "cpu", "--no-progress"])
    arguments.seed = seed
    torch.rand(7)  # whatever the generators held before
    return [row["loss"] for row in train_main(arguments).steps]


def test_the_clis_seed_fixes_the_weights_the_order_and_the_augmentation(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "seeds the initial weights" in " ".join(capsys.readouterr().out.split())  # what the run below checks
    first = cli_losses(4, monkeypatch)
    assert cli_losses(4, monkeypatch) == first
    assert cli_losses(5, monkeypatch) != first


def test_seed_none_leaves_the_generators_alone_so_a_loop_of_fits_draws_anew_and_replays_from_one_seed():
    """Every fit reseeded torch's global generator: an RL loop calling fit once per iteration drew the same dropout
    masks and data order every time. With seed=None each call draws on; one gk.seed_everything replays the loop."""

    def loop(model: nn.Module, data, **options) -> list[dict[str, torch.Tensor]]:
        gk.seed_everything(3)
        states = []
        for _ in range(2):  # each iteration from the same weights: only the draws can differ
            copied = copy.deepcopy(model)
            gk.fit(copied, data, seed=None, epochs=1, lr=0.05, progress=False, device="cpu", **options)
            states.append(copied.state_dict())
        return states

    for model, data, options in [
        (mlp_with_dropout(), tabular(), {"batch_size": 16}),
        (tiny_gpt(max_seq_len=16, width=16, dropout=0.2), [(t[:, :-1], t[:, 1:]) for t in tokens_batches()], {}),
    ]:
        first, second = loop(model, data, **options)
        assert_different_states(first, second)  # iteration 2 drew other masks (and, for the MLP, another order)
        replayed = loop(model, data, **options)
        assert_equal_states(first, replayed[0])
        assert_equal_states(second, replayed[1])
    with pytest.raises(ValueError, match="seed=None draws a new data order.*pass an integer seed with checkpoint_dir"):
        gk.fit(mlp_with_dropout(), tabular(), batch_size=16, seed=None, checkpoint_dir="unused", device="cpu")


def tokens_batches() -> list[torch.Tensor]:
    return [torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(index)) for index in range(3)]
