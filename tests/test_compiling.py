"""Regional compilation and launch overhead (issue 21 §4 and §5): each repeated block compiled in place computes what
the eager model computes, on a CNN and a transformer, through fit too, and is undone; a model without blocks and an
unknown compile mode are refused before any work. (torch.compile takes seconds per graph on a CPU: the structural
tests use the "eager" backend, which runs Dynamo's capture without generating code.)"""

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.compiling import compile_regions, launch_overhead, remove_compiled_regions
from tests.helpers import images, tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def cnn():
    """A stem and two identical conv-BatchNorm blocks (one compiled graph serves both), then a linear head."""
    torch.manual_seed(0)

    def block():
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), block(), block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
    )


def gpt_batch():
    inputs = tokens(4, 32)
    return inputs, inputs.roll(-1, dims=1)


MODELS = {
    "cnn": (cnn, lambda: (images(8, size=16), torch.arange(8) % 10)),
    "gpt": (tiny_gpt, gpt_batch),
}


@pytest.mark.parametrize("kind", MODELS)
def test_compiled_regions_compute_what_the_eager_model_computes_and_are_undone(kind):
    build, batch = MODELS[kind]
    torch._dynamo.reset()
    eager, compiled = build(), build()
    names = compile_regions(compiled, backend="eager")
    assert names == [name for name, *_ in gk.memory.find_blocks(compiled)] and names
    inputs, _ = batch()
    torch.testing.assert_close(compiled(inputs), eager(inputs))
    blocks = [block for _, block, _ in gk.memory.find_blocks(compiled)]
    assert all(block._compiled_call_impl is not None for block in blocks)
    remove_compiled_regions(compiled)
    assert all(block._compiled_call_impl is None for block in blocks)


def test_a_model_without_blocks_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="compile='whole'"):
        compile_regions(nn.Linear(4, 4))


@pytest.mark.parametrize("kind", MODELS)
def test_fit_compile_regional_trains_as_eager_and_gives_the_model_back(kind):
    build, batch = MODELS[kind]
    torch._dynamo.reset()
    options = dict(epochs=1, lr=0.05, device="cpu", progress=False, log_every=1)
    eager = gk.fit(build(), [batch()] * 3, **options)
    model = build()
    regional = gk.fit(model, [batch()] * 3, compile="regional", **options)
    assert [row["loss"] for row in regional.steps] == pytest.approx([row["loss"] for row in eager.steps], rel=1e-4)
    assert all(block._compiled_call_impl is None for _, block, _ in gk.memory.find_blocks(model))


@pytest.mark.parametrize("compile", ["partly", 1.5])
def test_fit_refuses_an_unknown_compile_mode_before_any_work(compile):
    with pytest.raises(ValueError, match="'regional'"):
        gk.fit(tiny_gpt(), [gpt_batch()], device="cpu", progress=False, compile=compile)


def test_fit_compile_regional_on_a_model_without_blocks_leaves_it_unchecked():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    with pytest.raises(ValueError, match="no repeated blocks"):
        gk.fit(model, [(images(4), torch.arange(4))], device="cpu", progress=False, compile="regional")


def test_launch_overhead_reports_both_timings_of_the_same_result():
    measured = launch_overhead("cpu", operators=20, elements=64, repeats=3)  # it asserts the results agree
    assert measured.operators == 20 and measured.unfused > 0 and measured.fused > 0
    assert measured.per_operator >= 0 and "per launch" in str(measured)


def test_compare_compilation_measures_each_mode_from_the_same_weights():
    model = tiny_gpt()
    variants = gk.compiling.compare_compilation(model, gpt_batch(), modes=("eager", "regional"), repeats=2)
    eager, regional = variants["eager"], variants["regional"]
    assert eager.traced_operators == 0 < regional.traced_operators
    assert regional.loss == pytest.approx(eager.loss, rel=1e-5)
    for got, expected in zip(regional.gradients, eager.gradients):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    assert all(len(v.step.times) == 2 and v.first_step > 0 for v in variants.values())
    assert all(parameter.grad is None for parameter in model.parameters())  # the model itself never ran
    with pytest.raises(ValueError, match="'eager', 'regional' or 'whole'"):
        gk.compiling.compare_compilation(model, gpt_batch(), modes=("fast",))


def test_count_operators_counts_forward_and_backward():
    model = tiny_gpt()
    inputs, target = gpt_batch()
    forward = gk.compiling.count_operators(lambda: model(inputs))
    both = gk.compiling.count_operators(
        lambda: nn.functional.cross_entropy(model(inputs).flatten(0, 1), target.flatten()).backward()
    )
    assert 0 < forward < both


def test_fit_compiles_selective_checkpointed_blocks_by_region():
    torch._dynamo.reset()
    options = dict(epochs=1, lr=0.05, device="cpu", progress=False, log_every=1)
    eager = gk.fit(tiny_gpt(), [gpt_batch()] * 3, **options)
    model = tiny_gpt()
    both = gk.fit(model, [gpt_batch()] * 3, compile="regional", activation_checkpointing="selective", **options)
    assert [row["loss"] for row in both.steps] == pytest.approx([row["loss"] for row in eager.steps], rel=1e-4)
    assert not gk.memory.has_activation_checkpointing(model)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", MODELS)
def test_fit_with_cuda_graphs_trains_as_eager_on_a_gpu(kind):
    build, batch = MODELS[kind]
    torch._dynamo.reset()
    options = dict(epochs=1, lr=0.05, device="cuda", progress=False, log_every=1)
    eager = gk.fit(build(), [batch()] * 4, **options)
    graphed = gk.fit(build(), [batch()] * 4, compile="reduce-overhead", **options)
    assert [row["loss"] for row in graphed.steps] == pytest.approx([row["loss"] for row in eager.steps], rel=1e-3)
