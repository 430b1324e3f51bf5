"""Selective activation checkpointing (issue 21 §1): policy="selective" keeps the matmul, convolution and attention
outputs and recomputes the rest, so it keeps less memory than no checkpointing and more than full checkpointing,
and trains exactly as both do; on a CNN (BatchNorm buffers updated once) and on a transformer; through fit."""

import copy
import inspect

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.memory.activation_checkpointing import apply_activation_checkpointing, has_activation_checkpointing
from tests.helpers import images, tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # bytes and equality, not seconds


def cnn():
    torch.manual_seed(0)
    return gk.models.fast_cnn(8)


def cnn_batch():
    return images(8), torch.arange(8) % 10


def gpt_batch():
    inputs = tokens(4, 32)
    return inputs, inputs.roll(-1, dims=1)


MODELS = {"cnn": (cnn, cnn_batch), "gpt": (tiny_gpt, gpt_batch)}


def variants(build):
    """The same weights without checkpointing, with full and with selective checkpointing."""
    plain = build()
    models = {"none": plain}
    for policy in ("full", "selective"):
        models[policy] = copy.deepcopy(plain)
        apply_activation_checkpointing(models[policy], policy=policy)
    return models


def gradients(model, batch):
    inputs, target = batch
    logits = model(inputs)
    nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten()).backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("kind", MODELS)
def test_selective_gives_the_gradients_and_buffers_of_no_checkpointing(kind):
    build, batch = MODELS[kind]
    models = variants(build)
    reference = gradients(models["none"], batch())
    for policy in ("full", "selective"):
        got = gradients(models[policy], batch())
        for name, gradient in reference.items():
            torch.testing.assert_close(got[name], gradient, rtol=1e-5, atol=1e-6, msg=f"{policy}: {name}")
        for (name, a), b in zip(models["none"].state_dict().items(), models[policy].state_dict().values()):
            assert torch.equal(a, b), f"{policy}: {name} (BatchNorm statistics updated once per step)"


@pytest.mark.parametrize("kind", MODELS)
def test_selective_keeps_less_than_none_and_more_than_full(kind):
    build, batch = MODELS[kind]
    kept = {policy: gk.memory.breakdown(model, batch(), device="cpu") for policy, model in variants(build).items()}
    forward = {policy: measured.kept_by_forward for policy, measured in kept.items()}
    assert forward["full"] < forward["selective"] < forward["none"], forward
    if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters:
        # torch 2.14 and later: what a selective region keeps is counted as saved activations too
        saved = {policy: measured.activations for policy, measured in kept.items()}
        assert saved["full"] < saved["selective"] < saved["none"], saved


def test_the_plan_says_selective_and_a_wrong_policy_is_refused():
    plan = apply_activation_checkpointing(tiny_gpt(), policy="selective")
    assert plan.policy == "selective" and "selective" in str(plan)
    with pytest.raises(ValueError, match="'full'.*'selective'"):
        apply_activation_checkpointing(tiny_gpt(), policy="some")


@pytest.mark.parametrize("kind", MODELS)
def test_fit_with_selective_checkpointing_trains_as_without_and_gives_the_model_back(kind):
    build, batch = MODELS[kind]
    data = [batch()] * 3
    options = dict(epochs=1, lr=0.05, device="cpu", progress=False, log_every=1)
    plain, checkpointed = build(), build()
    without = gk.fit(plain, data, **options)
    with_selective = gk.fit(checkpointed, data, activation_checkpointing="selective", **options)
    assert [row["loss"] for row in with_selective.steps] == pytest.approx([row["loss"] for row in without.steps])
    assert not has_activation_checkpointing(checkpointed)  # fit undid it
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[name], value, rtol=1e-4, atol=1e-6)


def test_fit_refuses_an_unknown_policy_before_any_work():
    model = tiny_gpt()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="policy 'some' is unknown"):
        gk.fit(model, [gpt_batch()], device="cpu", progress=False, activation_checkpointing="some")
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
