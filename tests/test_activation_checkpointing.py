import copy

import pytest
import torch
import torchvision
from torch import nn

import gpukit as gk
from gpukit import memory
from gpukit.memory.activation_checkpointing import (
    apply_activation_checkpointing,
    find_blocks,
    has_activation_checkpointing,
    remove_activation_checkpointing,
)
from tests.helpers import images

pytestmark = pytest.mark.usefixtures("one_thread")  # bytes and exact equality, not seconds (conftest.py)


def train_steps(model, steps=3):
    """A few SGD steps on fixed random batches; returns the last loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        labels = torch.arange(8) % 10
        loss = nn.functional.cross_entropy(model(images(8, seed=step)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# Same training, less memory


@pytest.mark.parametrize(
    "build, options",
    [
        (lambda: gk.models.fast_cnn(8), {}),  # FastCNN: every block its own region
        (gk.models.resnet18, {"every": 2}),  # regions of two BasicBlocks run by their nn.Sequential
    ],
)
def test_checkpointed_training_equals_unchecked_with_batchnorm_updated_once(build, options):
    torch.manual_seed(0)
    plain = build()
    checked = copy.deepcopy(plain)
    apply_activation_checkpointing(checked, **options)
    assert train_steps(plain) == pytest.approx(train_steps(checked), rel=1e-5)
    for (name, a), b in zip(plain.state_dict().items(), checked.state_dict().values()):
        if "running" in name or "num_batches_tracked" in name:
            assert torch.equal(a, b), name  # statistics updated exactly once per step, as without checkpointing
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    batchnorm = next(m for m in checked.modules() if isinstance(m, nn.BatchNorm2d))
    assert batchnorm.num_batches_tracked.item() == 3


@pytest.mark.parametrize("build", [lambda: gk.models.fast_cnn(8), gk.models.resnet18])
def test_checkpointing_saves_at_least_three_times_less_and_the_estimate_still_equals_it(build):
    torch.manual_seed(0)
    model = build()
    before = memory.breakdown(model, images(8), device="cpu")
    apply_activation_checkpointing(model)
    after = memory.breakdown(model, images(8), device="cpu")  # measures a copy: the copy is checkpointed too
    assert before.activations >= 3 * after.activations
    assert after.total < before.total  # the peak, measured independently of the saved-tensor hooks
    predicted = memory.estimate(model, images(8), device="cpu")  # recomputation runs on fake tensors too
    assert (predicted.activations, predicted.total) == (after.activations, after.total)


def test_evaluation_runs_without_checkpoints_and_gives_the_same_output():
    torch.manual_seed(0)
    model = gk.models.resnet18().eval()
    expected = model(images(4))
    apply_activation_checkpointing(model)
    with torch.no_grad():
        torch.testing.assert_close(model(images(4)), expected)
    torch.testing.assert_close(model(images(4)), expected)


# ---------------------------------------------------------------------------------------------
# Choosing regions


def test_blocks_and_regions():
    resnet18 = gk.models.resnet18()
    assert [name for name, *_ in find_blocks(resnet18)] == [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    assert [name for name, *_ in find_blocks(gk.models.fast_cnn(8))] == ["0", "1", "2", "3"]  # not pool, flatten, head
    assert len(apply_activation_checkpointing(gk.models.resnet18()).regions) == 8
    assert apply_activation_checkpointing(gk.models.resnet18(), every=2).regions == [
        [f"layer{s}.0", f"layer{s}.1"] for s in range(1, 5)
    ]  # regions never span two stages
    resnet50 = torchvision.models.resnet50()
    plan = apply_activation_checkpointing(resnet50, segments="sqrt")  # 16 blocks: regions of up to 4
    assert [len(region) for region in plan.regions] == [3, 4, 4, 2, 3] and "16 modules" in str(plan)
    plan = apply_activation_checkpointing(gk.models.resnet18(), modules=["layer1", "layer3.1"])
    assert plan.regions == [["layer1"], ["layer3.1"]]
    assert (
        len(
            apply_activation_checkpointing(gk.models.resnet18(), modules=[torchvision.models.resnet.BasicBlock]).regions
        )
        == 8
    )


def test_a_model_with_its_own_forward_gets_one_region_per_block_and_says_so():
    plan = apply_activation_checkpointing(gk.models.fast_cnn(8), every=2)
    assert plan.regions == [["0"], ["1"], ["2"], ["3"]]
    assert "FastCNN runs its blocks in its own forward()" in str(plan)


def test_remove_restores_the_model_and_names_never_change():
    model = gk.models.resnet18()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, every=2)
    assert list(model.state_dict()) == keys and has_activation_checkpointing(model)
    assert any("forward" in vars(module) for module in model.modules())
    copied = copy.deepcopy(model)  # the copy's regions run the copy's modules
    region = copied.layer1.forward.starts[0]
    assert region.modules[0] is copied.layer1[0]
    remove_activation_checkpointing(model)
    assert not has_activation_checkpointing(model) and not any("forward" in vars(module) for module in model.modules())
    assert list(model.state_dict()) == keys


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_requests_say_what_to_do():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 64), nn.ReLU(), nn.Linear(64, 10))
    with pytest.raises(ValueError, match="found no blocks to checkpoint in Linear.*modules=\\[...\\]"):
        apply_activation_checkpointing(nn.Linear(4, 2))  # an MLP's nn.Sequential is split: tests/test_output_forms.py
    plan = apply_activation_checkpointing(mlp, modules=["1"])  # named modules work for any model
    assert plan.regions == [["1"]]
    with pytest.raises(ValueError, match="no module named 'layer9'.*such as 'layer1.0'"):
        apply_activation_checkpointing(gk.models.resnet18(), modules=["layer9"])
    with pytest.raises(ValueError, match="'layer1.0' lies inside 'layer1'"):
        apply_activation_checkpointing(gk.models.resnet18(), modules=["layer1", "layer1.0"])
    with pytest.raises(ValueError, match="every must be a positive integer"):
        apply_activation_checkpointing(gk.models.resnet18(), every=0)
    with pytest.raises(ValueError, match="segments must be a positive integer or 'sqrt'"):
        apply_activation_checkpointing(gk.models.resnet18(), segments="half")
    with pytest.raises(ValueError, match="choose regions one way"):
        apply_activation_checkpointing(gk.models.resnet18(), every=2, modules=["layer1"])
    model = gk.models.resnet18()
    apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="already checkpointed; call .*remove_activation_checkpointing"):
        apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="not checkpointed"):
        remove_activation_checkpointing(gk.models.resnet18())
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        apply_activation_checkpointing(lambda x: x)
