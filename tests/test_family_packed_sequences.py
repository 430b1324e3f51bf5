"""A further family end to end: an LSTM classifier over variable-length sequences, padded in the batch and packed
inside forward (pack_padded_sequence with each sequence's length), so that the LSTM reads no padding.

Its batches are (tokens (B, T), lengths (B,), label (B,)): two integer inputs, of which only the tokens are token
ids. The LSTM is one layer, not a stack of blocks: fit's activation checkpointing finds nothing to checkpoint, and
says how to choose the parts before fit (fit takes no modules=). Everything runs on the CPU, seeded, on one thread.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence

import gpukit as gk
from tests.helpers import raising_at

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons (conftest.py)

CPU = torch.device("cpu")
VOCABULARY, LENGTH, CLASSES = 12, 20, 3  # token ids 1..11 (0 pads), up to 20 tokens a sequence


class Reader(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCABULARY, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # (B, T), (B,) -> (B, C)
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return self.head(hidden[-1])


def sequences(count: int, size: int = 6, seed: int = 0) -> list[tuple]:
    """Batches of padded token sequences: lengths up to LENGTH, more than the VOCABULARY's 12 ids."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(1, LENGTH + 1, (size,), generator=generator)
        tokens = torch.randint(1, VOCABULARY, (size, LENGTH), generator=generator) * (
            torch.arange(LENGTH) < lengths[:, None]
        )
        batches.append((tokens, lengths, torch.randint(0, CLASSES, (size,), generator=generator)))
    return batches


TRAIN = sequences(4)
PLAIN = dict(lr=0.05, schedule="constant", warmup=0, progress=False, device=CPU, seed=0)


def assert_bit_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_fit_trains_the_packed_lstm_as_a_hand_loop():
    assert max(int(lengths.max()) for _, lengths, _ in TRAIN) >= VOCABULARY  # lengths beyond the ids: no token ids
    model, hand = Reader(), Reader()
    gk.fit(model, TRAIN, optimizer="momentum", weight_decay=0, **PLAIN)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.05, momentum=0.9)
    for tokens, lengths, label in TRAIN:
        F.cross_entropy(hand(tokens, lengths), label).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_bit_equal(model, hand)
    assert not torch.equal(model.head.weight, Reader().head.weight)


@pytest.mark.parametrize("call", [3, 7])
def test_a_run_stopped_midway_resumes_bit_equal(call, tmp_path):
    options = dict(PLAIN, epochs=2, save_every=2, optimizer="adamw", lr=1e-2)
    straight = Reader()
    gk.fit(straight, TRAIN, checkpoint_dir=tmp_path / "a", **options)
    with pytest.raises(KeyboardInterrupt):
        gk.fit(
            Reader(),
            TRAIN,
            checkpoint_dir=tmp_path / "b",
            loss_fn=raising_at(call, F.cross_entropy, KeyboardInterrupt),
            **options,
        )
    torch.manual_seed(123)
    resumed = Reader()
    gk.fit(resumed, TRAIN, checkpoint_dir=tmp_path / "b", **options)
    assert_bit_equal(straight, resumed)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_fits_activation_checkpointing_says_how_to_checkpoint_a_model_without_blocks(policy):
    model = Reader()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError) as refused:
        gk.fit(model, TRAIN, activation_checkpointing=policy, **PLAIN)
    message = str(refused.value)
    assert "Pass modules=" not in message  # an argument fit does not take
    assert f"activation_checkpointing={policy!r}" in message and "Reader has neither" in message
    assert "gk.memory.apply_activation_checkpointing(model, modules=['lstm'])" in message  # its largest part
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    # What it says to do trains, with the LSTM recomputed in backward: the same weights as without.
    checkpointed, plain = Reader(), Reader()
    gk.memory.apply_activation_checkpointing(checkpointed, modules=["lstm"])
    gk.fit(checkpointed, TRAIN, **PLAIN)
    gk.fit(plain, TRAIN, **PLAIN)
    assert gk.memory.has_activation_checkpointing(checkpointed)
    assert_bit_equal(checkpointed, plain)


def test_an_empty_sequence_in_batch_3_is_torchs_error_with_the_batch_not_a_token_id():
    data = [*TRAIN[:2], (TRAIN[2][0], torch.where(torch.arange(6) == 2, 0, TRAIN[2][1]), TRAIN[2][2])]
    with pytest.raises(RuntimeError, match="greater than 0") as caught:  # pack_padded_sequence's own words
        gk.fit(Reader(), data, **PLAIN)
    assert not isinstance(caught.value, ValueError)  # no BatchError: the lengths are no token ids
    assert "It failed on batch 3 of epoch 1: inputs (6, 20) int64, (6,) int64" in caught.value.__notes__[0]
