"""Activation offloading (issue 21 §2): OffloadActivations trains as the model does, on a CNN and a GPT; on a GPU it
lowers the memory a step holds; on a CPU fit says there is nothing to offload; offload_cost's arithmetic."""

import copy

import pytest
import torch

import gpukit as gk
from gpukit.memory import OffloadActivations, offload_cost
from tests.helpers import images, tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "cnn": (lambda: gk.models.fast_cnn(8), lambda: (images(8), torch.arange(8) % 10)),
    "gpt": (tiny_gpt, lambda: (tokens(4, 32), tokens(4, 32, seed=1))),
}


def gradients(model, batch):
    inputs, target = batch
    torch.nn.functional.cross_entropy(model(inputs).flatten(0, -2), target.flatten()).backward()
    return [parameter.grad for parameter in model.parameters()]


@pytest.mark.parametrize("kind", MODELS)
def test_offloaded_forward_gives_the_same_gradients(kind, device):
    build, batch = MODELS[kind]
    torch.manual_seed(0)
    model = build().to(device)
    offloaded = OffloadActivations(copy.deepcopy(model))
    inputs, target = (tensor.to(device) for tensor in batch())
    for a, b in zip(gradients(model, (inputs, target)), gradients(offloaded, (inputs, target))):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MODELS)
def test_offloading_lowers_the_memory_a_step_holds_on_a_gpu(kind):
    build, batch = MODELS[kind]
    plain = gk.memory.breakdown(build(), batch(), device="cuda")
    offloaded = gk.memory.breakdown(OffloadActivations(build()), batch(), device="cuda")
    assert offloaded.kept_by_forward < plain.kept_by_forward


def test_fit_on_a_cpu_says_nothing_is_offloaded_and_trains():
    batch = (tokens(4, 32), tokens(4, 32, seed=1))
    with pytest.warns(UserWarning, match="nothing is offloaded"):
        history = gk.fit(tiny_gpt(), [batch] * 2, device="cpu", progress=False, offload_activations=True)
    assert len(history.epochs) == 1


def test_fit_refuses_a_non_boolean():
    with pytest.raises(TypeError, match="offload_activations must be True or False"):
        gk.fit(tiny_gpt(), [(tokens(1, 8), tokens(1, 8))], device="cpu", offload_activations="yes")


def test_offload_cost_is_twice_the_bytes_over_the_bandwidth():
    cost = offload_cost(100 * 10**6, 0.1, bandwidth=25e9)  # 100 MB out and back, a 100 ms step
    assert cost.bandwidth_to_hide == pytest.approx(2e9)
    assert cost.added_seconds == pytest.approx(0.008)
    assert "GB/s" in str(cost)
    with pytest.raises(ValueError, match="step_seconds > 0"):
        offload_cost(1, 0)
