"""A further family end to end: a Mamba-style language model, whose blocks mix the sequence with a gated recurrence
(a selective scan: state_t = a_t · state_{t-1} + (1 - a_t) · u_t, with a_t and u_t computed from the input at t)
instead of attention, written as a loop over positions as its users write it first.

It trains through fit as a hand loop does; the mistake checked is a token id beyond the vocabulary, named with the
batch and the table in the first batch as in any later one. Everything runs on the CPU, seeded, on one thread.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpukit as gk

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons (conftest.py)

CPU = torch.device("cpu")
VOCABULARY, WIDTH, LENGTH = 16, 8, 10


class SelectiveScan(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.input, self.output = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, W) -> (B, T, W)
        keep, update = torch.sigmoid(self.gate(hidden)), self.input(hidden)
        state, states = torch.zeros_like(hidden[:, 0]), []
        for t in range(hidden.shape[1]):
            state = keep[:, t] * state + (1 - keep[:, t]) * update[:, t]
            states.append(state)
        return hidden + self.output(torch.stack(states, 1))


class ScanLM(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.blocks = nn.ModuleList([SelectiveScan(), SelectiveScan()])
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, V) logits
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def token_batches(count: int, seed: int = 0) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCABULARY, (4, LENGTH), generator=generator) for _ in "xy") for _ in range(count)]


TRAIN = token_batches(3)
PLAIN = dict(lr=0.05, schedule="constant", warmup=0, progress=False, device=CPU, seed=0)


def test_fit_trains_the_scan_lm_as_a_hand_loop():
    model, hand = ScanLM(), ScanLM()
    history = gk.fit(model, TRAIN, **PLAIN)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    losses = []
    for tokens, labels in TRAIN:  # fit's default: Nesterov SGD, weight decay 5e-4 on every parameter
        loss = F.cross_entropy(hand(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    for (name, x), y in zip(model.state_dict().items(), hand.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert history.epochs[0]["train_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_token_id_beyond_the_vocabulary_is_named_in_the_first_batch_as_in_a_later_one(batch):
    data = [tuple(tensor.clone() for tensor in pair) for pair in TRAIN]
    data[batch - 1][0][1, 3] = VOCABULARY + 4  # id 20 of 16
    model = ScanLM()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"batch {batch} of epoch 1 .*embedding 'embed' .*0\.\.20.*16 rows"):
        gk.fit(model, data, **PLAIN)
    if batch == 1:  # refused before the first optimizer step
        assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
