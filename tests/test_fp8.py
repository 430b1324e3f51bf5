"""FP8 (issue 21 §3). Numerics on any machine: per-tensor scaled casts to e4m3 and e5m2 round within their formats'
steps, unscaled tiny values vanish, and a training step's weights, activations and gradients of a CNN and a GPT are
measured against bf16. Training with torchao: on a CPU in torchao's emulation (Float8LinearConfig(emulate=True): the
FP8 casts with fp32 matmuls), a CNN with Linear layers and a GPT train through fit with the layers whose dimensions
are multiples of 16 converted (before compiling) and given back after; the speed comparison runs its steps; and fit
refuses, before any work, a machine without FP8 tensor cores or torchao, naming what to do. The speed itself needs an
H100-class GPU (lesson 10 asserts it there). Tests that need torchao are skipped where it is not installed (the dev
extra installs it)."""

import math

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import fp8
from tests.fake_cuda import T4
from tests.helpers import images, tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")
needs_torchao = pytest.mark.skipif(
    not fp8.torchao_available(), reason="torchao is not installed (pip install 'gpukit[fp8]')"
)


def emulated():
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=True)


def cnn_with_linear_head() -> nn.Module:
    """The lessons' CNN with a two-layer head: Linear(32, 32) qualifies for FP8, Linear(32, 10) does not (10)."""
    torch.manual_seed(0)
    return nn.Sequential(gk.models.fast_cnn(8, num_classes=32), nn.ReLU(), nn.Linear(32, 10))


def test_a_scaled_cast_rounds_within_the_formats_step_and_keeps_the_range():
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-5  # gradient-sized
    for name, mantissa_bits in (("e4m3", 3), ("e5m2", 2)):
        quantized, scale = fp8.quantize(values, name)
        assert quantized.dtype == fp8.FORMATS[name]
        assert quantized.float().abs().max() == torch.finfo(quantized.dtype).max  # amax maps to the largest value
        error = (fp8.dequantize(quantized, scale) - values).abs() / values.abs()
        assert error[values.abs() > 1e-6].max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6  # half a step, relative
    assert fp8.relative_error(values, "e4m3", scaled=False) == pytest.approx(1.0)  # below e4m3's smallest: zeros
    assert fp8.relative_error(values, "e4m3") < fp8.relative_error(values, "e5m2") < 0.1
    assert fp8.relative_error(values, "bf16") < fp8.relative_error(values, "e4m3")


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="'e4m3', 'e5m2'"):
        fp8.quantize(torch.ones(2), "e3m4")


@pytest.mark.parametrize(
    "build, batch",
    [
        (lambda: gk.models.fast_cnn(8), lambda: (images(8), torch.arange(8) % 10)),
        (tiny_gpt, lambda: (tokens(4, 32), tokens(4, 32, seed=1))),
    ],
    ids=["cnn", "gpt"],
)
def test_numerics_of_a_training_step_rank_bf16_e4m3_e5m2(build, batch):
    model = build()
    measured = fp8.numerics(model, batch())
    linear_layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    for kind in ("weights", "activations", "gradients"):
        errors = measured[kind]
        assert errors.layers == linear_layers
        assert 0 < errors.bf16 < errors.e4m3 < errors.e5m2 < 0.1, errors
    # small gradients fall below e4m3's smallest numbers (2^-9) without a scale
    assert measured["gradients"].e4m3_unscaled > measured["gradients"].e4m3
    assert all(parameter.grad is None for parameter in model.parameters())
    assert len(measured.table()) == 3


def test_numerics_names_a_model_without_linear_layers():
    with pytest.raises(ValueError, match="no nn.Linear"):
        fp8.numerics(torch.nn.Conv2d(3, 3, 1), (images(2), images(2)))


# ---------------------------------------------------------------------------------------------
# Training with torchao


def test_only_plain_linear_layers_with_dimensions_multiple_of_16_are_chosen():
    assert fp8.convertible(cnn_with_linear_head()) == ["0.6"]  # the head's Linear(32, 32), not Linear(32, 10)
    gpt = tiny_gpt()
    linear_layers = [name for name, module in gpt.named_modules() if isinstance(module, nn.Linear)]
    assert fp8.convertible(gpt) == linear_layers and len(linear_layers) == 9  # 4 per block (width 32) and the head
    assert not fp8.linear_filter(nn.MultiheadAttention(32, 2).out_proj)  # a subclass: its forward is not called
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.convertible(gk.models.fast_cnn(8))  # its only Linear has 10 outputs
    with pytest.raises(TypeError, match="nn.Sequential"):
        fp8.convertible(nn.Linear(16, 16))


@needs_torchao
@pytest.mark.parametrize("build", [cnn_with_linear_head, tiny_gpt], ids=["cnn", "gpt"])
def test_convert_and_unconvert_keep_the_parameters(build):
    from torchao.float8.float8_linear import Float8Linear

    model = build()
    parameters, state = list(model.parameters()), model.state_dict()
    names = fp8.convert(model, emulated())
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], Float8Linear) for name in names)
    assert list(model.parameters()) == parameters and list(model.state_dict()) == list(state)
    assert sorted(fp8.unconvert(model)) == sorted(names)
    assert not any(isinstance(module, Float8Linear) for module in model.modules())
    assert all(a is b for a, b in zip(model.parameters(), parameters))  # an optimizer built on them carries on


@needs_torchao
@pytest.mark.parametrize(
    "build, data, options",
    [
        (cnn_with_linear_head, "small_data", dict(batch_size=32)),
        (tiny_gpt, "corpus", dict(batch_size=8, optimizer="adamw", lr=3e-3)),
    ],
    ids=["cnn", "gpt"],
)
def test_fit_trains_in_emulated_fp8_close_to_fp32_and_gives_the_layers_back(build, data, options, request, device):
    train = request.getfixturevalue(data)[0]
    options |= dict(max_steps=4, log_every=1, progress=False, device=device)
    plain = [row["loss"] for row in gk.fit(build(), train, **options).steps]
    model = build()
    parameters = list(model.parameters())
    losses = [row["loss"] for row in gk.fit(model, train, fp8=emulated(), **options).steps]
    # The FP8 casts change the numbers a little (e4m3's step is 2^-3 relative, scaled per tensor), not the training.
    assert losses != plain and all(math.isclose(a, b, rel_tol=0.02) for a, b in zip(losses, plain)), (losses, plain)
    assert all(type(module) is nn.Linear for module in model.modules() if isinstance(module, nn.Linear))  # given back
    assert all(a is b for a, b in zip(model.parameters(), parameters))


@needs_torchao
def test_fit_converts_before_checkpointing_and_compiling(corpus, device):
    """fp8 with selective checkpointing and with compile: the recomputed regions and the compiled graph run the FP8
    layers (the aot_eager backend: the same graph capture as the default, without the minutes of code generation a
    CPU would need), as the plain FP8 run does."""
    options = dict(batch_size=8, max_steps=3, log_every=1, progress=False, device=device, fp8=emulated())
    eager = gk.fit(tiny_gpt(seed=4), corpus[0], **options)
    compiled = gk.fit(tiny_gpt(seed=4), corpus[0], compile={"backend": "aot_eager"}, **options)
    checkpointed = gk.fit(tiny_gpt(seed=4), corpus[0], activation_checkpointing="selective", **options)
    plain = gk.fit(tiny_gpt(seed=4), corpus[0], **(options | dict(fp8=False)))
    for losses in (compiled.losses, checkpointed.losses):
        assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, eager.losses)), (losses, eager.losses)
    assert compiled.losses != plain.losses  # (FP8 changed them: the compiled graph did not run plain layers)


class Untouchable:
    """Training data whose use fails the test: fit must refuse before it reads any."""

    def __iter__(self):
        raise AssertionError("fit read the data before refusing")

    def __len__(self):
        raise AssertionError("fit read the data before refusing")


def test_fit_refuses_fp8_where_it_cannot_run_before_any_work(monkeypatch):
    with pytest.raises(ValueError, match="compute capability 8.9.*runs on cpu.*emulate=True"):
        gk.fit(tiny_gpt(), Untouchable(), fp8=True, device="cpu")
    with pytest.raises(TypeError, match="fp8 must be True, False or a torchao.float8.Float8LinearConfig"):
        gk.fit(tiny_gpt(), Untouchable(), fp8="e4m3", device="cpu")
    ready, reason = fp8.supported("cpu")
    assert not ready and "FP8 tensor cores" in reason


@pytest.mark.parametrize("fake_cuda", [[T4]], indirect=True)
def test_a_gpu_without_fp8_tensor_cores_is_named(fake_cuda):
    with pytest.raises(ValueError, match="Tesla T4 has 7.5"):
        fp8.training_config(True, "cuda")
    assert "Tesla T4 has 7.5" in fp8.supported("cuda")[1]


def test_an_h100_without_torchao_says_what_to_install(fake_cuda, monkeypatch):
    monkeypatch.setattr(fp8.training, "torchao_available", lambda: False)  # where the checks read it
    with pytest.raises(ImportError, match=r"pip install 'gpukit\[fp8\]'"):
        fp8.training_config(True, "cuda")
    assert fp8.supported("cuda") == (False, fp8.training._TORCHAO_MISSING)
    with pytest.raises(ImportError, match=r"gpukit\[fp8\]"):
        fp8.convert(tiny_gpt())


@needs_torchao
def test_an_h100_with_torchao_is_ready(fake_cuda):
    ready, reason = fp8.supported("cuda")
    assert ready and "compute capability 9.0" in reason
    assert not fp8.training_config(True, "cuda").emulate  # torchao's default recipe: real FP8 matmuls


@needs_torchao
def test_emulated_fp8_without_linear_layers_to_convert_is_refused_before_any_work(device):
    with pytest.raises(ValueError, match="multiples of 16"):
        gk.fit(gk.models.fast_cnn(8), Untouchable(), fp8=emulated(), device=device)


@needs_torchao
def test_compare_speed_times_each_variant_at_each_shape(device):
    shapes = {"small": (32, 32, 16), "large": (64, 64, 32)}
    speed = fp8.compare_speed(
        shapes, device=device, config=emulated(), warmup=1, repeats=2, compile_options={"backend": "aot_eager"}
    )
    table = speed.table()
    assert len(table) == 6 and set(table.column("variant")) == {"bf16 compiled", "fp8 compiled", "fp8 eager"}
    assert speed.speedup("large", "bf16 compiled") == 1 and speed.speedup("small") > 0
    assert all(row["TFLOP/s"] > 0 for row in table)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.compare_speed({"odd": (8, 10, 16)}, device=device, config=emulated())
    with pytest.raises(ValueError, match="runs on cpu"):
        fp8.compare_speed(device=device)  # real FP8 matmuls: refused before building anything


@pytest.mark.gpu
@needs_torchao
def test_real_fp8_through_fit_trains_close_to_bf16_on_a_gpu_with_fp8_tensor_cores(corpus):
    ready, reason = fp8.supported("cuda")
    if not ready:
        pytest.skip(reason)
    options = dict(batch_size=8, max_steps=4, log_every=1, progress=False, device="cuda", precision="bf16-mixed")
    bf16 = gk.fit(tiny_gpt(), corpus[0], **options).losses
    model = tiny_gpt()
    losses = gk.fit(model, corpus[0], fp8=True, **options).losses
    assert losses != bf16 and all(math.isclose(a, b, rel_tol=0.02) for a, b in zip(losses, bf16)), (losses, bf16)
    assert all(type(module) is nn.Linear for module in model.modules() if isinstance(module, nn.Linear))
