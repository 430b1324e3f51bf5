"""Optimizers by name, parameter groups, Muon with AdamW, optimizer state bytes, lr_find, ZeRO."""

import math
import sys

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.optim import OPTIMIZERS, make_optimizer, muon_parameters
from tests.helpers import tiny_gpt

pytestmark = pytest.mark.timeout(300)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return gk.models.fast_cnn(4)


def gpt() -> nn.Module:
    return tiny_gpt(width=16, max_seq_len=8)


def sample(model) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if isinstance(model, gk.models.GPT):
        tokens = torch.randint(0, 256, (4, 9), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator)


def one_step(model, optimizer) -> None:
    inputs, target = sample(model)
    gk.step.TrainStep(model, optimizer, gk.get_precision("fp32", "cpu"))((inputs, target))


def measured_state_bytes(optimizer) -> int:
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("build", [cnn, gpt], ids=["cnn", "gpt"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_name_steps_and_its_state_bytes_are_predicted(name, build):
    model = build()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(name, model, 1e-3, 1e-2)
    one_step(model, optimizer)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), f"{name} changed nothing"
    assert measured_state_bytes(optimizer) == gk.memory.optimizer_state_bytes(model, name)


def test_memory_estimate_and_breakdown_count_the_same_state():
    model, images = cnn(), torch.randn(2, 3, 32, 32)
    for name in ("lamb", "muon"):  # one from timm, and the two-part one
        predicted = gk.memory.optimizer_state_bytes(model, name)
        assert gk.memory.estimate(model, images, optimizer=name, device="cpu").optimizer_state == predicted
        assert gk.memory.breakdown(model, images, optimizer=name, device="cpu").optimizer_state == predicted


def test_state_is_two_and_one_copies_of_the_parameters():
    model = cnn()
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    tensors = len(list(model.parameters()))
    assert gk.memory.optimizer_state_bytes(model, "adamw") == 2 * parameter_bytes + 4 * tensors
    assert gk.memory.optimizer_state_bytes(model, "momentum") == parameter_bytes


def _groups(optimizer) -> tuple[set, set]:
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    return decayed, plain


NORMS = (nn.BatchNorm2d, nn.LayerNorm)


def _norms_and_biases(model) -> set:
    found = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, NORMS) or name == "bias":
                found.add(id(p))
    return found


@pytest.mark.parametrize("build", [cnn, gpt], ids=["cnn", "gpt"])
@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_biases_and_norms_are_not_decayed(name, build):
    model = build()
    decayed, plain = _groups(make_optimizer(name, model, 1e-3, 0.1))
    everything = {id(p) for p in model.parameters()}
    assert plain == _norms_and_biases(model) and decayed == everything - plain and plain
    decayed, plain = _groups(make_optimizer(name, model, 1e-3, 0.1, no_decay_1d=False))
    assert decayed == everything and not plain
    decayed, plain = _groups(make_optimizer("nesterov", model, 1e-3, 0.1))  # the classic form decays everything
    assert decayed == everything


def test_muon_takes_hidden_weights_only():
    model = gpt()
    hidden, rest = muon_parameters(model)
    expected = {id(m.weight) for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in hidden} == expected
    assert id(model.token_embedding.weight) in {id(p) for p in rest}  # the embedding, tied to the head
    model = cnn()
    hidden, rest = muon_parameters(model)
    assert {id(p) for p in hidden} == {id(m.weight) for m in model.modules() if isinstance(m, nn.Conv2d)}
    assert id(model[-1].weight) in {id(p) for p in rest}  # the output head


def test_muon_updates_channels_last_filters_through_their_view():
    model = cnn().to(memory_format=torch.channels_last)
    optimizer = make_optimizer("muon", model, 1e-2, 0.0)
    first = model[0][0].weight
    before = first.detach().clone()
    one_step(model, optimizer)
    assert not torch.equal(before, first)
    state = optimizer.state_dict()
    again = make_optimizer("muon", model, 1e-2, 0.0)
    again.load_state_dict(state)
    assert measured_state_bytes(again) == measured_state_bytes(optimizer)


def test_fit_trains_a_cnn_and_a_gpt_with_muon(device):
    images, labels = sample(cnn())
    options = dict(
        optimizer="muon", lr=1e-2, schedule="linear", warmup_steps=2, progress=False, log_every=1, device=device
    )
    history = gk.fit(cnn(), [(images, labels)] * 15, **options)  # one batch, learnt by heart
    assert history.steps[-1]["loss"] < 0.5 * history.steps[0]["loss"]
    assert len({row["lr"] for row in history.steps}) > 5  # the schedule drove the learning rate
    text = torch.arange(400) % 8  # a repeating pattern: the next token is easy to learn
    windows = [(text[i : i + 8][None].repeat(8, 1), text[i + 1 : i + 9][None].repeat(8, 1)) for i in range(0, 45, 3)]
    history = gk.fit(gpt(), windows, **options)
    assert history.steps[-1]["loss"] < 0.75 * history.steps[0]["loss"]  # 15 steps from ln(256): 0.63× measured


def test_bad_optimizer_inputs(monkeypatch):
    model = cnn()
    with pytest.raises(ValueError, match="'lamb'.*'muon'"):
        make_optimizer("adam_w", model, 1e-3, 0.0)
    for lr in (0, -1e-3, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"lr must be a positive number \(finite\)"):
            make_optimizer("adamw", model, lr, 0.0)
    with pytest.raises(ValueError, match="weight_decay must be a finite number >= 0"):
        make_optimizer("adamw", model, 1e-3, -0.1)
    with pytest.raises(ValueError, match="lr must be"):
        gk.fit(model, gk.data.shapes(64, 8)[0], lr=-1.0, progress=False, device="cpu")
    monkeypatch.setitem(sys.modules, "timm.optim", None)  # as if timm were not installed
    for name in ("lamb", "lars"):
        with pytest.raises(ImportError, match=r"gpukit\[optim\]"):
            make_optimizer(name, model, 1e-3, 0.0)
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ImportError, match="torch 2.9"):
        make_optimizer("muon", model, 1e-3, 0.0)


# ---------------------------------------------------------------------------------------------
# lr_find


def test_lr_find_restores_model_and_optimizer_and_finds_a_minimum(device):
    model = cnn()
    images = gk.data.shapes(30 * 16, 16, seed=0)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one_step(model, optimizer)  # optimizer state to restore
    inputs, target = sample(model)
    nn.functional.cross_entropy(model(inputs), target).backward()  # gradients left behind, to restore
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    result = gk.lr_find(
        model, images, optimizer=optimizer, steps=30, batch_size=16, start_lr=1e-3, end_lr=100.0, device=device
    )
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # bit-equal, buffers too
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(m, optimizer.state[p]["momentum_buffer"]) for m, p in zip(momentum, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert "diverged" in result.stopped and len(result.lrs) < 30  # lr 100 blows the loss up
    lowest = min(result.smoothed[len(result.smoothed) // 10 :])  # after the first tenth of the steps, as stated
    assert result.lrs[result.smoothed.index(lowest)] == result.lowest_lr <= result.best_lr == 10 * result.suggestion
    assert result.plot() is not None  # the rule itself: tests/test_lr_find.py


class DictModel(nn.Module):
    """Takes a dict batch: model(**batch) with features and labels, returns its own loss."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, features, labels):
        logits = self.layer(features)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def test_lr_find_with_dict_and_token_batches_precision_and_accumulation(device):
    generator = torch.Generator().manual_seed(0)
    batches = [
        {"features": torch.randn(8, 4, generator=generator), "labels": torch.randint(0, 3, (8,))} for _ in range(20)
    ]
    result = gk.lr_find(DictModel(), batches, optimizer="adamw", steps=20, accumulate=2, device=device)
    assert len(result.lrs) >= 3
    model = gpt()
    tokens = [sample(model) for _ in range(8)]
    result = gk.lr_find(model, tokens, optimizer="muon", steps=20, precision="bf16-mixed", device=device)
    assert all(math.isfinite(loss) for loss in result.losses[:3])


def test_lr_find_bad_inputs(device):
    batches = [sample(cnn()) for _ in range(5)]
    with pytest.raises(ValueError, match="end_lr"):
        gk.lr_find(cnn(), batches, start_lr=1.0, end_lr=0.1, steps=20, device=device)
    with pytest.raises(ValueError, match="lr must be"):
        gk.lr_find(cnn(), batches, start_lr=0.0, steps=20, device=device)


# ---------------------------------------------------------------------------------------------
# ZeRO


def zero_worker():
    gk.distributed.setup()
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(4)
    ]
    results = gk.distributed.compare_sharding(lambda: gk.models.fast_cnn(4), batches, optimizer="adamw", lr=1e-2)
    gk.distributed.cleanup()
    return results


def test_zero_shards_optimizer_state_and_matches_ddp():
    ranks = gk.distributed.launch(zero_worker, 2, backend="gloo", timeout=240)
    model = gk.models.fast_cnn(4)
    full = gk.memory.optimizer_state_bytes(model, "adamw")
    largest = max(2 * p.nbytes + 4 for p in model.parameters())  # ZeRO assigns whole tensors to ranks
    for result in ranks:
        assert result["ddp"]["optimizer"] == full
        assert abs(result["ddp+zero"]["optimizer"] - full / 2) <= largest
        assert abs(result["fsdp2"]["optimizer"] - full / 2) <= largest
        assert torch.equal(result["ddp+zero"]["final_parameters"], result["ddp"]["final_parameters"])
        torch.testing.assert_close(result["fsdp2"]["final_parameters"], result["ddp"]["final_parameters"])
    assert sum(result["ddp+zero"]["optimizer"] for result in ranks) == full
    with pytest.raises(RuntimeError, match="setup"):
        gk.distributed.zero_optimizer(model)
