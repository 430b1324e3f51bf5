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


class Tracking(nn.Module):
    """A block that keeps state in buffers: a call counter (written in place) and a running mean of its
    input (replaced each call), which its output depends on, so a recomputation must see the forward's."""

    def __init__(self, width=16):
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.norm(self.linear(x - self.mean))


def test_every_buffer_a_region_changes_ends_each_step_as_without_checkpointing():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), Tracking(), Tracking(), nn.Linear(16, 4))
    checked = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checked).regions == [["1"], ["2"]]
    for model in (plain, checked):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            inputs = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            nn.functional.cross_entropy(model(inputs), torch.arange(6) % 4).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert checked[1].calls.item() == checked[2].calls.item() == 4  # counted once per step, not twice
    for (name, a), b in zip(plain.named_buffers(), checked.buffers()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        torch.testing.assert_close(a, b, msg=name)  # the recomputation saw the buffers the forward saw


# ---------------------------------------------------------------------------------------------
# Hugging Face models (config.use_cache)


def tiny_t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0
    )
    return transformers.T5ForConditionalGeneration(config)


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def hf_gradients(model, tokens):
    torch.manual_seed(1)  # dropout: the same masks in both models (checkpoint replays the generator's state)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("build", [tiny_t5, tiny_gpt2], ids=["t5", "gpt2"])
def test_a_hugging_face_model_trains_with_use_cache_off_and_gets_it_back(build):
    torch.manual_seed(0)
    plain = build().train()
    checked = copy.deepcopy(plain)
    caches = {id(m.config): m.config.use_cache for m in checked.modules() if hasattr(m, "config")}
    assert True in caches.values()
    plan = apply_activation_checkpointing(checked)
    assert len(plan.regions) == (4 if build is tiny_t5 else 2) and "use_cache set to False" in str(plan)
    assert not any(m.config.use_cache for m in checked.modules() if hasattr(m, "config"))
    tokens = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss, expected = hf_gradients(plain, tokens)
    checked_loss, got = hf_gradients(checked, tokens)  # T5 failed here: the decoder's cache filled twice
    assert checked_loss == pytest.approx(loss, rel=1e-6)
    for name, gradient in expected.items():
        torch.testing.assert_close(got[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    remove_activation_checkpointing(checked)
    assert {id(m.config): m.config.use_cache for m in checked.modules() if hasattr(m, "config")} == caches


# ---------------------------------------------------------------------------------------------
# Frozen regions


def saved_bytes(model, inputs, labels) -> int:
    """Bytes autograd saves in one forward, outside parameters, each storage once (tensors kept alive
    meanwhile, so no freed storage's address is reused), counted by hooks of this test's own."""
    resident = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = nn.functional.cross_entropy(model(inputs), labels)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    loss.backward()
    return sum(size for pointer, size in storages.items() if pointer not in resident)


def frozen_resnet(trainable=("fc",)):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(trainable))
    return model


def test_a_frozen_backbone_is_not_checkpointed_for_nothing():
    plain = frozen_resnet()
    checked = copy.deepcopy(plain)
    plan = apply_activation_checkpointing(checked)
    assert "8 regions have no trainable parameter" in str(plan)
    inputs, labels = images(4), torch.arange(4)
    without = saved_bytes(plain, inputs, labels)
    assert saved_bytes(checked, inputs, labels) <= without  # it kept 70x more: every region's inputs
    torch.testing.assert_close(checked.fc.weight.grad, plain.fc.weight.grad)
    # frozen blocks whose inputs need a gradient (a trainable stem) are still checkpointed, and save memory
    plain = frozen_resnet(trainable=("conv1", "bn1", "fc"))
    checked = copy.deepcopy(plain)
    apply_activation_checkpointing(checked)
    without = saved_bytes(plain, inputs, labels)
    assert saved_bytes(checked, inputs, labels) < 0.7 * without  # the blocks keep their inputs only
    torch.testing.assert_close(checked.conv1.weight.grad, plain.conv1.weight.grad, rtol=1e-4, atol=1e-6)


def test_the_estimate_of_a_checkpointed_frozen_model_is_repeatable_and_near_the_measurement():
    model = frozen_resnet()
    apply_activation_checkpointing(model)
    batch = (images(8), torch.arange(8))
    estimates = [memory.estimate(model, batch, device="cpu") for _ in range(5)]  # gave 16.8-19.4 MB
    assert len({(e.activations, e.total) for e in estimates}) == 1
    measured = memory.breakdown(model, batch, device="cpu")
    assert estimates[0].activations == pytest.approx(measured.activations, rel=0.1)
    assert estimates[0].total == pytest.approx(measured.total, rel=0.1)


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


class MixtureOfExperts(nn.Module):
    """Top-1 routing over a ModuleList of experts run in a loop: `expert` builds one expert."""

    def __init__(self, expert, count=4, width=16):
        super().__init__()
        self.router = nn.Linear(width, count)
        self.experts = nn.ModuleList(expert(width) for _ in range(count))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        output = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            chosen = choice == index
            output[chosen] = expert(x[chosen])
        return output


def test_a_model_without_blocks_is_told_what_was_searched_found_and_what_to_pass():
    class ThreeLayers(nn.Module):  # an MLP of its own, not in an nn.Sequential: its order is unknown
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc3(self.fc2(self.fc1(x).relu()).relu())

    with pytest.raises(ValueError, match="searched its nn.Sequential.*found none.*modules=\\['fc1', 'fc2', 'fc3'\\]"):
        apply_activation_checkpointing(ThreeLayers())
    moe = MixtureOfExperts(lambda width: nn.Linear(width, width))  # experts without submodules are no blocks
    with pytest.raises(ValueError, match="found only ModuleList 'experts' of 4 Linear.*modules=\\[nn.Linear\\]"):
        apply_activation_checkpointing(moe)
    plan = apply_activation_checkpointing(moe, modules=[f"experts.{index}" for index in range(4)])
    assert "4 modules (4 Linear) checkpointed in 4 regions" in str(plan)  # the summary names what was wrapped
    assert "(8 BasicBlock)" in str(apply_activation_checkpointing(gk.models.resnet18()))


def test_experts_with_submodules_are_blocks_and_train_as_without_checkpointing():
    torch.manual_seed(0)
    plain = MixtureOfExperts(lambda width: nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, width)))
    checked = copy.deepcopy(plain)
    plan = apply_activation_checkpointing(checked)
    assert plan.regions == [[f"experts.{index}"] for index in range(4)] and "(4 Sequential)" in str(plan)
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    for model in (plain, checked):
        model(inputs).square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checked.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


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
