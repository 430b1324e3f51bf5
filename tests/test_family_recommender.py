"""A further family end to end: a recommender with sparse embedding tables (nn.Embedding(sparse=True), one for users
and one for items) and a dense head, trained as its users train it: torch.optim.SparseAdam for the tables beside Adam
for the rest, passed to fit as a list (gk.optim.Combined: one set of parameter groups for the schedule, one state).

A sparse gradient holds one row per id looked up (its indices, int64, and values); only SparseAdam, and SGD and
Adagrad without weight decay, can apply one: fit's default optimizer (SGD with weight decay) is refused before any
work, in fit and in gk.memory alike. Everything runs on the CPU, seeded, on one thread.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk
from tests.helpers import raising_at

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons and byte counts (conftest.py)

CPU = torch.device("cpu")
USERS, ITEMS, DIM = 50, 20, 8


class Recommender(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.users = nn.Embedding(USERS, DIM, sparse=True)
        self.items = nn.Embedding(ITEMS, DIM, sparse=True)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:  # (B,), (B,) int64 -> (B,) ratings
        return self.head(torch.cat([self.users(users), self.items(items)], dim=-1)).squeeze(-1)


def optimizers(model: Recommender) -> list[torch.optim.Optimizer]:
    tables = [model.users.weight, model.items.weight]
    return [torch.optim.SparseAdam(tables, lr=1e-2), torch.optim.Adam(model.head.parameters(), lr=1e-3)]


def ratings(sizes: list[int], seed: int = 0) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, USERS, (size,), generator=generator),
            torch.randint(0, ITEMS, (size,), generator=generator),
            torch.rand(size, generator=generator) * 5,
        )
        for size in sizes
    ]


TRAIN = ratings([6] * 6)
PLAIN = dict(lr=None, progress=False, device=CPU, seed=0, loss_fn="mse")


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_fit_with_sparse_adam_beside_adam_is_a_hand_loop_with_both_and_their_schedules():
    """The linear schedule decays each optimizer's own lr (1e-2 and 1e-3): its factor reaches both."""
    model, hand = Recommender(), Recommender()
    history = gk.fit(model, TRAIN, optimizer=optimizers(model), schedule="linear", warmup=0, log_every=1, **PLAIN)
    parts = optimizers(hand)
    schedules = [torch.optim.lr_scheduler.LambdaLR(part, lambda step: (6 - step) / 6) for part in parts]
    torch.manual_seed(0)
    for users, items, target in TRAIN:
        F.mse_loss(hand(users, items), target).backward()
        for part in parts:
            part.step()
            part.zero_grad()
        for schedule in schedules:
            schedule.step()
    assert_bit_equal(model, hand)
    assert not torch.equal(model.items.weight, Recommender().items.weight)  # the tables trained
    assert [row["lr"] for row in history.steps] == pytest.approx([1e-2 * (6 - step) / 6 for step in range(6)])
    assert history.steps[0]["lr_group1"] == pytest.approx(1e-3)  # Adam's group, at its own lr


@pytest.mark.parametrize("call", [4, 9])
def test_a_run_with_two_optimizers_resumes_bit_equal(call, tmp_path):
    """Ctrl-C at loss call 4 (after the save at step 2) or 9 (epoch 2): both optimizers' moments are saved."""
    options = dict(PLAIN, epochs=2, save_every=2, schedule="linear", warmup=0.2)
    straight = Recommender()
    gk.fit(straight, TRAIN, optimizer=optimizers(straight), checkpoint_dir=tmp_path / "a", **options)
    stopped = Recommender()
    with pytest.raises(KeyboardInterrupt):
        gk.fit(
            stopped,
            TRAIN,
            optimizer=optimizers(stopped),
            checkpoint_dir=tmp_path / "b",
            **dict(options, loss_fn=raising_at(call, F.mse_loss, KeyboardInterrupt)),
        )
    torch.manual_seed(123)
    resumed = Recommender()
    parts = optimizers(resumed)
    gk.fit(resumed, TRAIN, optimizer=parts, checkpoint_dir=tmp_path / "b", **options)
    assert_bit_equal(straight, resumed)
    assert parts[0].state[resumed.users.weight]["step"] > 0  # SparseAdam's state came back and went on


def test_the_default_optimizer_on_sparse_tables_is_refused_before_any_work_in_fit_and_memory():
    model = Recommender()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    refused = r"embedding 'users' is built with sparse=True.*'nesterov' with weight_decay=0.0005.*SparseAdam"
    with pytest.raises(ValueError, match=refused):
        gk.fit(model, TRAIN, **PLAIN)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    with pytest.raises(ValueError, match=refused):  # not "the sample batch does not fit the model"
        gk.memory.estimate(model, TRAIN[0], loss_fn="mse", device=CPU)
    with pytest.raises(ValueError, match=r"'items' .*Adam cannot apply"):  # Adam given a table: named too
        gk.fit(model, TRAIN, optimizer=torch.optim.Adam(model.items.parameters()), **PLAIN)


def test_memory_counts_each_sparse_gradients_indices_and_values():
    """A sparse gradient of a table looked up with B ids holds indices (1, B) int64 and values (B, D) float32, one row
    per id (repeats kept); the head's gradient is dense. estimate measures a real step here (fake tensors give a
    sparse gradient no rows), with a warning; breakdown counts the same."""
    batch, size = TRAIN[0], 6
    sparse = 2 * (8 * size + 4 * size * DIM)  # users and items
    dense = 4 * (2 * DIM + 1)  # the head's weight and bias
    sgd = lambda parameters: torch.optim.SGD(parameters, lr=0.1)  # noqa: E731 (applies sparse gradients)
    with pytest.warns(UserWarning, match="measured one real training step"):
        predicted = gk.memory.estimate(Recommender(), batch, loss_fn="mse", optimizer=sgd, device=CPU)
    measured = gk.memory.breakdown(Recommender(), batch, loss_fn="mse", optimizer=sgd, device=CPU)
    assert predicted.grads == measured.grads == sparse + dense


def test_an_id_beyond_one_table_is_named_where_a_larger_table_would_hold_it():
    """Item id 25 in batch 2: out of range for the items' 20 rows, not for the users' 50."""
    data = list(TRAIN)
    users, items, target = data[1]
    data[1] = (users, torch.where(torch.arange(6) == 3, 25, items), target)
    model = Recommender()
    with pytest.raises(ValueError, match=r"batch 2 of epoch 1 .*embedding 'items' .*lie in \d+\.\.25.*20 rows"):
        gk.fit(model, data, optimizer=optimizers(model), **PLAIN)
