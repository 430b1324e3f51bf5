"""A further family end to end: quantization-aware training (torch.ao.quantization.prepare_qat), whose fake-quant
modules keep observer buffers that every forward moves, in eval mode too, and that grow at their first forward (a
per-channel observer's min_val from shape (0,) to one value per output channel, its scale from (1,)).

So: fit's checks before training (eval_data's first batch through the model) must leave every buffer as it was; a
first batch that fails (bf16, which these modules do not take) puts the grown observers back, saying torch's own
error; a run resumes into a model prepared afresh (after a kernel restart); and lr_find puts the model back exactly,
or says it cannot with nothing changed. Everything runs on the CPU, seeded, on one thread.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.ao import quantization
from torch.nn import functional as F

import gpukit as gk
from tests.helpers import raising_at

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.ao.quantization moves to torchao
]

CPU = torch.device("cpu")


def prepared(seed: int = 0) -> nn.Module:
    """A small classifier prepared for QAT as its users write it: fake-quant on the weights and activations."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        quantization.QuantStub(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), quantization.DeQuantStub()
    )
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantization.prepare_qat(model.train())


def batches(count: int, size: int = 6, seed: int = 0) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator))
        for _ in range(count)
    ]


TRAIN, HELD_OUT = batches(5), batches(1, seed=1)
SGD = dict(optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.05), lr=None)
PLAIN = dict(schedule="constant", warmup=0, progress=False, device=CPU, seed=0, **SGD)


def state(model: nn.Module) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}


def assert_same_state(model: nn.Module, expected: dict) -> None:
    now = model.state_dict()
    assert now.keys() == expected.keys()
    for name, value in expected.items():
        assert now[name].shape == value.shape and torch.equal(now[name], value), name


def test_fit_with_eval_data_is_bit_equal_to_a_hand_loop_that_evaluates_after_the_epoch():
    """The check of eval_data before training runs a forward that moves 20 observer buffers: put back, fit equals a
    hand loop that trains, then evaluates (which moves them, as fit's evaluation after the epoch does)."""
    model, hand = prepared(), prepared()
    history = gk.fit(model, TRAIN, eval_data=HELD_OUT, **PLAIN)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.05)
    torch.manual_seed(0)
    for x, y in TRAIN:
        F.cross_entropy(hand(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    hand.eval()
    with torch.no_grad():
        held_out_loss = F.cross_entropy(hand(HELD_OUT[0][0]), HELD_OUT[0][1]).item()
    assert_same_state(model, state(hand))  # weights and every observer's ranges, scales and zero points
    assert history.epochs[0]["eval_loss"] == pytest.approx(held_out_loss, rel=1e-6)


def test_the_checks_before_training_leave_every_buffer_as_it_was():
    model = prepared()
    before = state(model)
    assert before["1.weight_fake_quant.scale"].shape == (1,)  # grows at the first forward
    gk.fit(model, TRAIN, eval_data=HELD_OUT, epochs=0, **PLAIN)  # every check, no step
    assert_same_state(model, before)
    with torch.no_grad():
        model.eval()(HELD_OUT[0][0])
    assert model.state_dict()["1.weight_fake_quant.scale"].shape == (16,)  # (what the check's forward did)


def test_bf16_failing_on_the_first_batch_says_torchs_error_and_puts_the_grown_observers_back():
    model = prepared()
    before = state(model)
    with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=torch.bfloat16):  # a hand loop fails too: torch's
        prepared()(TRAIN[0][0])  # limit (its fake-quant kernels take float32)
    with pytest.raises(ValueError, match=r"first batch.*RuntimeError: expected scalar type Float but found BFloat16"):
        gk.fit(model, TRAIN, precision="bf16-mixed", **PLAIN)
    assert_same_state(model, before)  # the observers that forward grew are back to their shapes and values


@pytest.mark.parametrize("call", [4, 8])
def test_a_run_resumes_into_a_model_prepared_afresh(call, tmp_path):
    """Stopped by Ctrl-C at loss call 4 (after the save at step 2) or 8 (epoch 2), then resumed, as after a kernel
    restart, into a model prepared again, whose observers have not grown yet: bit-equal to a run never stopped."""
    options = dict(PLAIN, epochs=2, save_every=2, log_every=1)  # (no eval_data: its check's forward grew them)
    straight = prepared()
    gk.fit(straight, TRAIN, checkpoint_dir=tmp_path / "a", **options)
    with pytest.raises(KeyboardInterrupt):
        gk.fit(
            prepared(),
            TRAIN,
            checkpoint_dir=tmp_path / "b",
            loss_fn=raising_at(call, F.cross_entropy, KeyboardInterrupt),
            **options,
        )
    torch.manual_seed(123)
    resumed = prepared()
    assert resumed.state_dict()["1.weight_fake_quant.activation_post_process.min_val"].shape == (0,)
    gk.fit(resumed, TRAIN, checkpoint_dir=tmp_path / "b", **options)
    assert_same_state(resumed, state(straight))


def test_lr_find_puts_a_model_prepared_afresh_back_exactly():
    model = prepared()
    before = state(model)
    result = gk.lr_find(model, TRAIN, steps=20, device=CPU)
    assert_same_state(model, before)  # 39 entries, the grown observers back to (0,) and (1,)
    assert len(result.lrs) >= 20


class Counting(nn.Module):
    """A layer that registers a buffer at its first forward: its state changes form, which no load can undo."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        if not hasattr(self, "calls"):
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.calls += 1
        return self.linear(x)


def test_lr_find_that_cannot_put_the_model_back_says_so_and_changes_nothing():
    torch.manual_seed(0)
    model = Counting()
    before = state(model)
    with pytest.raises(RuntimeError, match=r"cannot put the model back.*calls is new.*Nothing was put back"):
        gk.lr_find(model, TRAIN, steps=20, device=CPU)
    assert "calls" in model.state_dict()
    changed = [name for name, value in before.items() if not torch.equal(model.state_dict()[name], value)]
    assert changed == ["linear.weight", "linear.bias"]  # all of the sweep's weights kept: none half put back
